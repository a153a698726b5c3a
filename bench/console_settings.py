"""The production settings (``config.settings``, from the environment) plus a query counter in
front of every other middleware: ``DJANGO_SETTINGS_MODULE=bench.console_settings`` for the
benchmarks' server. Nothing else differs."""

from config.settings import *  # noqa: F403
from config.settings import MIDDLEWARE

MIDDLEWARE = ["bench.querycount.QueryCountMiddleware", *MIDDLEWARE]
