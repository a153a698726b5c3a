"""What a scraper, a probe and an alert see of the engine: ``/metrics`` (Prometheus),
``/healthz`` and ``/readyz``, and their commands (``manage.py metrics``, ``check_health``).

The counters are the engine's (recovery.engine.metrics); the gauges are read from the database
on each scrape through recovery.counts, the same numbers the console shows."""
