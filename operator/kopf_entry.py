"""Handlers on kopf's default registry, for ``kopf run -m pdserve.operator.kopf_entry``.

``pdserve operator`` is the normal entry point; this module exists for kopf's
own CLI and for ``kopf.testing.KopfRunner``. The status interval comes from
``PDSERVE_OPERATOR_STATUS_INTERVAL`` (seconds), the autoscaler tick from
``PDSERVE_OPERATOR_AUTOSCALE_TICK``, the router metrics URL template from
``PDSERVE_OPERATOR_ROUTER_METRICS_URL`` and the pod policy's opt-ins from
``PDSERVE_OPERATOR_MODEL_HOST_PATHS`` (colon-separated directories) and
``PDSERVE_OPERATOR_ALLOW_UNSAFE_POD_FIELDS=1``.
"""

from __future__ import annotations

import kopf

from pdserve import env
from pdserve.operator.autoscaler import AutoscaleSettings
from pdserve.operator.handlers import OperatorConfig, register
from pdserve.operator.pod_policy import PodPolicy

register(
    kopf.get_default_registry(),
    OperatorConfig(
        status_interval=env.get_float(env.OPERATOR_STATUS_INTERVAL, 10),
        retry_delay=env.get_float(env.OPERATOR_RETRY_DELAY, 30),
        autoscale_tick=env.get_float(env.OPERATOR_AUTOSCALE_TICK, 5),
        default_image=env.get(env.DEFAULT_IMAGE),
        autoscale=AutoscaleSettings(
            router_metrics_url=env.get(env.OPERATOR_ROUTER_METRICS_URL),
            metrics_url_allow=tuple(
                filter(None, env.get(env.OPERATOR_METRICS_URL_ALLOW).split(","))
            ),
        ),
        pod_policy=PodPolicy(
            allow_unsafe=env.get(env.OPERATOR_ALLOW_UNSAFE_POD_FIELDS) == "1",
            model_host_paths=tuple(filter(None, env.get(env.OPERATOR_MODEL_HOST_PATHS).split(":"))),
        ),
    ),
)
