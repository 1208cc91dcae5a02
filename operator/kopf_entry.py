"""Handlers on kopf's default registry, for ``kopf run -m pdserve.operator.kopf_entry``.

``pdserve operator`` is the normal entry point; this module exists for kopf's
own CLI and for ``kopf.testing.KopfRunner``. The status interval comes from
``PDSERVE_OPERATOR_STATUS_INTERVAL`` (seconds), the autoscaler tick from
``PDSERVE_OPERATOR_AUTOSCALE_TICK`` and the router metrics URL template from
``PDSERVE_OPERATOR_ROUTER_METRICS_URL``.
"""

from __future__ import annotations

import os

import kopf

from pdserve.operator.autoscaler import AutoscaleSettings
from pdserve.operator.handlers import OperatorConfig, register

register(
    kopf.get_default_registry(),
    OperatorConfig(
        status_interval=float(os.environ.get("PDSERVE_OPERATOR_STATUS_INTERVAL", "10")),
        retry_delay=float(os.environ.get("PDSERVE_OPERATOR_RETRY_DELAY", "30")),
        autoscale_tick=float(os.environ.get("PDSERVE_OPERATOR_AUTOSCALE_TICK", "5")),
        default_image=os.environ.get("PDSERVE_DEFAULT_IMAGE", ""),
        autoscale=AutoscaleSettings(
            router_metrics_url=os.environ.get("PDSERVE_OPERATOR_ROUTER_METRICS_URL", "")
        ),
    ),
)
