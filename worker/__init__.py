"""What the prefill and decode worker servers share: ``http`` (flags, errors, the service
secret, the common routes) and ``metrics`` (their Prometheus metrics)."""
