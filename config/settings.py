"""Settings from the environment (12-factor). Every default makes the embedded mode work:
SQLite files under var/, the executor in-process, no broker needed."""

import os
import sys
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"
VAR_DIR.mkdir(exist_ok=True)  # the embedded SQLite files live here


def env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def env_bool(name: str, default: bool) -> bool:
    value = env(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


DEBUG = env_bool("DJANGO_DEBUG", True)
SECRET_KEY = env("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set when DJANGO_DEBUG is off")
    SECRET_KEY = "insecure-embedded-default-only-for-local-use"

ALLOWED_HOSTS = [h.strip() for h in env("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")]

INSTALLED_APPS = [
    "recovery.closed_commands",  # before django.contrib.auth: closes its createsuperuser and changepassword
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "simple_history",
    "recovery",
    "workflows",
    "sandbox",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "simple_history.middleware.HistoryRequestMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "recovery.console.context.roles",
                "recovery.console.context.executor_health",
            ],
        },
    },
]


# The executor's hot path runs as prepared statements on PostgreSQL (recovery/rows.py). 0 behind
# a connection pooler that cannot keep them (PgBouncer before 1.21 in transaction mode).
RECOVERY_PREPARED_STATEMENTS = env("RECOVERY_PREPARED_STATEMENTS", "1") == "1"


def database(url: str) -> dict:
    # Persistent connections suit Celery workers (a connection per task costs a backend
    # start); leave 0 for runserver, which opens one per request thread.
    config = dj_database_url.parse(url, conn_max_age=int(env("DATABASE_CONN_MAX_AGE", "0")), conn_health_checks=True)
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # WAL lets readers work beside the one writer; IMMEDIATE takes the write lock at
        # BEGIN so two writers queue on busy_timeout instead of failing on lock upgrade.
        config["OPTIONS"] = {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=30000;",
        }
    elif config["ENGINE"] == "django.db.backends.postgresql" and RECOVERY_PREPARED_STATEMENTS:
        # Prepare only what asks to be (the executor's hot path, recovery/rows.py): Django's
        # own cursors bind on the client and never prepare.
        config["OPTIONS"] = {**config.get("OPTIONS", {}), "prepare_threshold": sys.maxsize}
    return config


DATABASES = {
    "default": database(env("DATABASE_URL", f"sqlite:///{VAR_DIR / 'recovery.sqlite3'}")),
    # The simulated external systems' own database: `migrate --database sandbox`.
    "sandbox": database(env("SANDBOX_DATABASE_URL", f"sqlite:///{VAR_DIR / 'sandbox.sqlite3'}")),
}
DATABASE_ROUTERS = ["sandbox.routers.SandboxRouter"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Every password a person sets (createoperator, the demo's logins) passes these (docs/security.md,
# "Passwords and logins"). 12 characters: at the per-user, per-address and global login limits
# below an online guesser gets a few hundred guesses a day, and 12 characters of anything not on
# the common list is far out of that reach; it is also what a passphrase of three words reaches.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "console:runs"
LOGOUT_REDIRECT_URL = "login"

# --- Celery (only used when RECOVERY_EXECUTOR=celery) ---------------------------------
CELERY_BROKER_URL = env("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# How often a sweeper looks for due work: Celery beat's sweep, and the embedded executor's beat.
RECOVERY_SWEEP_SECONDS = float(env("RECOVERY_SWEEP_SECONDS", "5"))
if RECOVERY_SWEEP_SECONDS <= 0:
    raise ImproperlyConfigured("RECOVERY_SWEEP_SECONDS must be > 0")
CELERY_BEAT_SCHEDULE = {
    "recovery-sweep": {
        "task": "recovery.tasks.sweep",
        "schedule": RECOVERY_SWEEP_SECONDS,
        # A sweep stuck behind a backlog is stale by the time a worker gets it: drop it.
        "options": {"expires": RECOVERY_SWEEP_SECONDS},
    },
}

# --- Recovery engine -------------------------------------------------------------------
# "embedded": run_executor advances runs in-process, no broker.
# "celery": starting a run enqueues recovery.tasks.advance_run on commit; beat sweeps.
RECOVERY_EXECUTOR = env("RECOVERY_EXECUTOR", "embedded")
if RECOVERY_EXECUTOR not in {"embedded", "celery"}:
    raise ImproperlyConfigured("RECOVERY_EXECUTOR must be 'embedded' or 'celery'")
RECOVERY_LEASE_SECONDS = float(env("RECOVERY_LEASE_SECONDS", "30"))
# The executor renews its lease this often while a call is in flight (the heartbeat); at most a
# third of the lease, so that two missed beats still leave the lease standing.
RECOVERY_HEARTBEAT_SECONDS = float(env("RECOVERY_HEARTBEAT_SECONDS", str(RECOVERY_LEASE_SECONDS / 3)))
if not 0 < RECOVERY_HEARTBEAT_SECONDS <= RECOVERY_LEASE_SECONDS / 2:
    raise ImproperlyConfigured("RECOVERY_HEARTBEAT_SECONDS must be > 0 and at most half of RECOVERY_LEASE_SECONDS")
# The default in-flight bound of a step that declares none is its call's timeout plus this: how
# long a receiver may still commit a request after its caller gave up (docs/recovery-contract.md
# "Unknown outcomes and the in-flight window"). A look-up that finds nothing proves absence only after it.
RECOVERY_SETTLE_SECONDS = float(env("RECOVERY_SETTLE_SECONDS", "60"))
if RECOVERY_SETTLE_SECONDS < 0:
    raise ImproperlyConfigured("RECOVERY_SETTLE_SECONDS must be ≥ 0")
# An executor that has not beaten for this long is silent (docs/operating.md "Executors"): with
# none beating, every console page says so, and runs due (or whose lease expired) this long
# ago count as stuck, cause "no_executor". Default: three sweep intervals, at least one lease.
RECOVERY_EXECUTOR_SILENT_SECONDS = float(
    env("RECOVERY_EXECUTOR_SILENT_SECONDS", str(max(3 * RECOVERY_SWEEP_SECONDS, RECOVERY_LEASE_SECONDS)))
)
if RECOVERY_EXECUTOR_SILENT_SECONDS < RECOVERY_SWEEP_SECONDS:
    raise ImproperlyConfigured("RECOVERY_EXECUTOR_SILENT_SECONDS must be at least RECOVERY_SWEEP_SECONDS")
# A queued task for a run (or an outbox message) is not sent again by the sweeper until it is
# this old without a worker having taken it: a backlog is not multiplied, a lost message is
# re-sent (celery only).
RECOVERY_REDISPATCH_SECONDS = float(env("RECOVERY_REDISPATCH_SECONDS", "60"))
# Modules that declare workflows; each is imported when the app registry is ready.
RECOVERY_WORKFLOW_MODULES = [
    m.strip() for m in env("RECOVERY_WORKFLOW_MODULES", "workflows.registry").split(",") if m.strip()
]

# --- Observability (docs/operating.md#metrics-and-health) -----------------------------------
# RECOVERY_METRICS=0 records no metric. /metrics answers a scraper that presents this token
# (Authorization: Bearer …); unset, the endpoint is off (404).
RECOVERY_METRICS = env_bool("RECOVERY_METRICS", True)
RECOVERY_METRICS_TOKEN = env("RECOVERY_METRICS_TOKEN", "")
# Every process (gunicorn's and Celery's workers, run_executor) writes its counters to files in
# PROMETHEUS_MULTIPROC_DIR, read by prometheus_client when it is first imported: empty it when
# the deployment starts. Unset, each process counts for itself alone.
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
# /readyz and check_health: the sweeper (beat, or the embedded executor) must have swept within
# this many seconds.
RECOVERY_READY_BEAT_SECONDS = float(env("RECOVERY_READY_BEAT_SECONDS", "60"))
if RECOVERY_READY_BEAT_SECONDS <= 0:
    raise ImproperlyConfigured("RECOVERY_READY_BEAT_SECONDS must be > 0")

# Alerts on stuck runs (Workflow(stuck_after=…); recovery/observability/alerts.py). The webhook
# is signed with HMAC-SHA256 under its secret; e-mails go through Django's e-mail backend.
RECOVERY_CONSOLE_URL = env("RECOVERY_CONSOLE_URL", f"http://127.0.0.1:{env('PORT', '8000')}").rstrip("/")
RECOVERY_ALERT_WEBHOOK_URL = env("RECOVERY_ALERT_WEBHOOK_URL", "")
RECOVERY_ALERT_WEBHOOK_SECRET = env("RECOVERY_ALERT_WEBHOOK_SECRET", "")
# Systems that send a waiting run its event signed, as our alert webhook is signed, instead of with
# an API token (the tracker's callback): HMAC-SHA256 of "timestamp.body" under this secret
# (X-Recovery-Sender, X-Recovery-Timestamp, X-Recovery-Signature; recovery.api.run_events). Empty:
# only tokens. A fixed one in DEBUG, shared with the embedded tracker (SANDBOX_CALLBACK_SECRET).
RECOVERY_EVENT_SIGNING_SECRET = env("RECOVERY_EVENT_SIGNING_SECRET", "embedded-event-signing-secret" if DEBUG else "")
if RECOVERY_EVENT_SIGNING_SECRET and len(RECOVERY_EVENT_SIGNING_SECRET) < 16:
    raise ImproperlyConfigured("RECOVERY_EVENT_SIGNING_SECRET signs events sent to runs: 16 characters or more")
if RECOVERY_ALERT_WEBHOOK_URL and len(RECOVERY_ALERT_WEBHOOK_SECRET) < 16:
    raise ImproperlyConfigured("RECOVERY_ALERT_WEBHOOK_SECRET (16 characters or more) signs the alert webhook")
RECOVERY_ALERT_EMAILS = [a.strip() for a in env("RECOVERY_ALERT_EMAILS", "").split(",") if a.strip()]
RECOVERY_SMTP_PASSWORD = env("DJANGO_EMAIL_HOST_PASSWORD", "")  # a secret: redacted wherever it appears
_mail_backend = env("DJANGO_EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
MAILERS = {
    "default": {
        "BACKEND": _mail_backend,
        "OPTIONS": {
            "host": env("DJANGO_EMAIL_HOST", "localhost"),
            "port": int(env("DJANGO_EMAIL_PORT", "25")),
            "username": env("DJANGO_EMAIL_HOST_USER", ""),
            "password": RECOVERY_SMTP_PASSWORD,
            "use_tls": env_bool("DJANGO_EMAIL_USE_TLS", False),
            "timeout": float(env("DJANGO_EMAIL_TIMEOUT", "10")),  # an alert's sweep never waits longer
        }
        if _mail_backend.endswith("smtp.EmailBackend")
        else {},
    }
}
DEFAULT_FROM_EMAIL = env("DJANGO_DEFAULT_FROM_EMAIL", "recovery-console@localhost")

# The demo (docs/security.md "The demo in production"): the /demo page (arm faults, clear the
# simulated systems, start runs, reseed) and seed_demo. Off unless RECOVERY_DEMO=1 (make run
# sets it): when off, /demo answers 404 and the console links no demo.
RECOVERY_DEMO = env_bool("RECOVERY_DEMO", False)
TEMPLATES[0]["OPTIONS"]["context_processors"].append("sandbox.context.demo")

# Traces (OpenTelemetry; pip install -e '.[otel]'): off unless RECOVERY_TRACING=1.
RECOVERY_TRACING = env_bool("RECOVERY_TRACING", False)
RECOVERY_TRACING_SERVICE = env("OTEL_SERVICE_NAME", "recovery-console")

# --- Simulated external systems and the adapters that call them -----------------------
SANDBOX_URL = env("SANDBOX_URL", f"http://127.0.0.1:{env('PORT', '8000')}").rstrip("/")
# Seconds an adapter waits for a response once its request is sent; past it, the outcome is unknown.
RECOVERY_HTTP_TIMEOUT = float(env("RECOVERY_HTTP_TIMEOUT", "5"))

# --- Model providers -------------------------------------------------------------------
MODEL_PROVIDER = env("MODEL_PROVIDER", "rules")
if MODEL_PROVIDER not in {"rules", "scripted", "openai"}:
    raise ImproperlyConfigured("MODEL_PROVIDER must be 'rules', 'scripted' or 'openai'")
# MODEL_PROVIDER=scripted: a JSON file mapping invoice ids to the model's raw output (the rules
# answer the others). The demo's seed uses it for its off-schema model.
MODEL_SCRIPT = env("MODEL_SCRIPT", "")
OPENAI_BASE_URL = env("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/")
OPENAI_API_KEY = env("OPENAI_API_KEY", "")
OPENAI_MODEL = env("OPENAI_MODEL", "gpt-4o-mini")
# Shorter than RECOVERY_LEASE_SECONDS (manage.py check says so otherwise).
OPENAI_TIMEOUT = float(env("OPENAI_TIMEOUT", "20"))

# --- Redaction (recovery/redaction.py) ----------------------------------------------------
# Checkpoints, audit events, exports and logs never hold a credential. Unset, these take the
# defaults in recovery/redaction.py: RECOVERY_REDACT_FIELDS (key names whose values are
# replaced), RECOVERY_REDACT_PATTERNS (name -> regex, replaced in every string) and
# RECOVERY_REDACT_SETTINGS (the settings whose values are secrets, replaced wherever they
# appear: SECRET_KEY, OPENAI_API_KEY, SANDBOX_API_KEY, RECOVERY_METRICS_TOKEN,
# RECOVERY_ALERT_WEBHOOK_SECRET, RECOVERY_SMTP_PASSWORD, RECOVERY_EVENT_SIGNING_SECRET,
# SANDBOX_CALLBACK_SECRET).

# The redact filter runs on the handler: a logger's own filters never see its children's
# records. recovery.apps also redacts every record where it is created, for other handlers.

# --- Hostile input: Content-Security-Policy and request limits ----------------------------
# (kept in one block: docs/security.md "Hostile input and Content-Security-Policy")
# Every response carries an enforced policy: scripts and styles only from our own static
# files (htmx is vendored), no inline script, no inline style, no eval, no plugins, no framing,
# forms and requests only to this origin. Console pages never need a nonce. Django's admin
# templates put a per-request nonce on the few inline <style> blocks they render
# ({% csp_nonce_attr %}); the nonce appears in the header only on a response that used it.
from django.utils.csp import CSP  # noqa: E402

MIDDLEWARE.insert(
    MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1,
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
)
MIDDLEWARE.append("recovery.console.middleware.RejectNulCharactersMiddleware")
TEMPLATES[0]["OPTIONS"]["context_processors"].append("django.template.context_processors.csp")
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF, CSP.NONCE],
    "img-src": [CSP.SELF],
    "connect-src": [CSP.SELF],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "object-src": [CSP.NONE],
}

# RECOVERY_LOG_FORMAT=json: one JSON object per line, with the run, step and actor a record is
# about (recovery/logs.py); "text" (the default): one plain line.
RECOVERY_LOG_FORMAT = env("RECOVERY_LOG_FORMAT", "text")
if RECOVERY_LOG_FORMAT not in {"text", "json"}:
    raise ImproperlyConfigured("RECOVERY_LOG_FORMAT must be 'text' or 'json'")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "redact": {"()": "recovery.redaction.RedactingFilter"},
        "context": {"()": "recovery.logs.ContextFilter"},
    },
    "formatters": {
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "recovery.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": RECOVERY_LOG_FORMAT,
            "filters": ["redact", "context"],
        }
    },
    "loggers": {
        "recovery": {"handlers": ["console"], "level": env("RECOVERY_LOG_LEVEL", "INFO")},
        "workflows": {"handlers": ["console"], "level": env("RECOVERY_LOG_LEVEL", "INFO")},
        # Every unhandled exception of a request (a 500) with its traceback, redacted, whatever
        # DJANGO_DEBUG says (Django's own handler for it prints only in DEBUG); and runserver's
        # request lines. A crashed command logs through "recovery" (recovery.management.base).
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
        "django.server": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}

# step_state_kind_idx INCLUDEs run_id on PostgreSQL; SQLite builds it on the key columns only.
SILENCED_SYSTEM_CHECKS = ["models.W040"]

# --- Access control and production security (docs/security.md) ----------------------------
# One block on purpose: Content-Security-Policy lives in its own block, maintained apart.
AUTHENTICATION_BACKENDS = ["recovery.console.login_throttle.ThrottledModelBackend"]
# A username with this many failed logins in the last RECOVERY_LOGIN_LOCKOUT_SECONDS is refused
# (429, even with the right password) until fewer remain in that window; a success resets it.
# Counted in the database, so every web process sees the same failures.
RECOVERY_LOGIN_MAX_FAILURES = int(env("RECOVERY_LOGIN_MAX_FAILURES", "5"))
RECOVERY_LOGIN_LOCKOUT_SECONDS = float(env("RECOVERY_LOGIN_LOCKOUT_SECONDS", "900"))
if RECOVERY_LOGIN_MAX_FAILURES < 1 or RECOVERY_LOGIN_LOCKOUT_SECONDS <= 0:
    raise ImproperlyConfigured("RECOVERY_LOGIN_MAX_FAILURES must be ≥ 1 and RECOVERY_LOGIN_LOCKOUT_SECONDS > 0")
# Beside it: failures from one client address across usernames in the same window (0: off), and
# failures across the whole console in a short window, a high ceiling that slows a distributed
# spray while an operator is refused for at most RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS at a time.
RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS = int(env("RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS", "20"))
RECOVERY_LOGIN_MAX_FAILURES_GLOBAL = int(env("RECOVERY_LOGIN_MAX_FAILURES_GLOBAL", "100"))
RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS = float(env("RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS", "60"))
if (
    RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS < 0
    or RECOVERY_LOGIN_MAX_FAILURES_GLOBAL < 0
    or RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS <= 0
):
    raise ImproperlyConfigured(
        "RECOVERY_LOGIN_MAX_FAILURES_PER_ADDRESS and _GLOBAL must be ≥ 0 (0: off) "
        "and RECOVERY_LOGIN_GLOBAL_WINDOW_SECONDS > 0"
    )
# The client's address is REMOTE_ADDR. Behind reverse proxies, name the header they set
# (e.g. X-Forwarded-For) and how many of them append to it: the address is that many entries from
# the right. Never trusted by default: a client can write any X-Forwarded-For it likes.
_client_header = (env("RECOVERY_TRUSTED_PROXY_HEADER") or "").strip().upper().replace("-", "_")
RECOVERY_TRUSTED_PROXY_HEADER = (
    _client_header if not _client_header or _client_header.startswith("HTTP_") else f"HTTP_{_client_header}"
)
RECOVERY_TRUSTED_PROXY_COUNT = int(env("RECOVERY_TRUSTED_PROXY_COUNT", "1"))
if RECOVERY_TRUSTED_PROXY_COUNT < 1:
    raise ImproperlyConfigured("RECOVERY_TRUSTED_PROXY_COUNT must be ≥ 1")
# The simulated systems' own credential (what a tracker's API token is to its adapter): the
# adapters send it as a Bearer token, the sandbox refuses any request without it. A fixed key in
# DEBUG (the embedded demo on 127.0.0.1); in production the sandbox is closed unless it is set.
SANDBOX_API_KEY = env("SANDBOX_API_KEY", "embedded-sandbox-key" if DEBUG else "")
# The tracker's own secret for signing the callbacks it sends when a task is approved or rejected
# (sandbox.services.decide_task): the engine checks them with RECOVERY_EVENT_SIGNING_SECRET.
SANDBOX_CALLBACK_SECRET = env("SANDBOX_CALLBACK_SECRET", RECOVERY_EVENT_SIGNING_SECRET)

# The dispute workflow's credit notes above this amount wait for a supervisor's approval before
# anything is posted (its tool's needs_approval; workflows.dispute). Above 1000.00 its guard refuses.
DISPUTE_CREDIT_APPROVAL_ABOVE = env("DISPUTE_CREDIT_APPROVAL_ABOVE", "500.00")
# The invoice workflow (v3) posts an invoice above this amount only once its approver approved the
# task in the tracker, which calls the run back (workflows.invoice).
INVOICE_APPROVAL_WAIT_ABOVE = env("INVOICE_APPROVAL_WAIT_ABOVE", "20000.00")
for _name in ("DISPUTE_CREDIT_APPROVAL_ABOVE", "INVOICE_APPROVAL_WAIT_ABOVE"):
    if not globals()[_name].replace(".", "", 1).isdigit():
        raise ImproperlyConfigured(f"{_name}={globals()[_name]!r}: an amount such as 500.00")

# Sessions: one shift (8 h from login, not extended by the console's polling), gone when the
# browser closes. SameSite=Lax: every state change is a POST with a CSRF token (the permission
# matrix in tests/test_access_matrix.py pins it), and Lax withholds the cookie from cross-site
# POSTs; Strict would also drop it on links into a run page from the tracker or the chat.
SESSION_COOKIE_AGE = int(env("DJANGO_SESSION_COOKIE_AGE", str(8 * 3600)))
SESSION_EXPIRE_AT_BROWSER_CLOSE = True
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
# No script reads the CSRF cookie: pages carry the token ({% csrf_token %}, and base.html's
# hx-headers for htmx), so the cookie can be HttpOnly.
CSRF_COOKIE_HTTPONLY = True
CSRF_TRUSTED_ORIGINS = [o.strip() for o in env("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"  # workflow ids (tenant, invoice) never leave in a Referer
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
# Production (DJANGO_DEBUG=0) is served over TLS: cookies only over HTTPS, HTTP redirected to
# HTTPS, HSTS. Behind a TLS-terminating proxy set DJANGO_SECURE_PROXY_SSL_HEADER (e.g.
# "HTTP_X_FORWARDED_PROTO,https"), and only if the proxy overwrites that header.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = not DEBUG
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]  # a container's probes speak plain HTTP
SECURE_HSTS_SECONDS = int(env("DJANGO_SECURE_HSTS_SECONDS", "0" if DEBUG else "31536000"))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", True)
_proxy_header = env("DJANGO_SECURE_PROXY_SSL_HEADER")
if _proxy_header:
    _name, _, _value = _proxy_header.partition(",")
    if not _name.strip().startswith("HTTP_") or not _value.strip():
        raise ImproperlyConfigured('DJANGO_SECURE_PROXY_SSL_HEADER must look like "HTTP_X_FORWARDED_PROTO,https"')
    SECURE_PROXY_SSL_HEADER = (_name.strip(), _value.strip())
