"""One settings module, driven by environment variables.

Embedded defaults (SQLite in WAL mode, an embedded Redis started by `config.launch`)
serve one person on one machine; `DATABASE_URL` and `REDIS_URL` switch to shared
servers for a team.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config import launcher_state
from config.private_files import private_data_dir
from config.env import env_bool, env_int, env_list, env_str, env_toml_strings, env_toml_table

BASE_DIR = Path(__file__).resolve().parent.parent
# Everything the app writes at run time (database, uploads, Redis files) lives here.
DATA_DIR = Path(env_str("DATA_DIR", str(BASE_DIR / "var")))

SECRET_KEY = env_str("SECRET_KEY", "insecure-local-key-set-SECRET_KEY-in-production")
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# HTTPS=1 when the app is served over TLS (directly or behind a proxy that sets
# X-Forwarded-Proto: then also SECURE_PROXY_SSL_HEADER=1). It turns on the redirect, secure
# cookies and HSTS, so `manage.py check --deploy` is clean; off, the quick start keeps
# working over plain http://127.0.0.1. docs/security.md explains each setting.
HTTPS = env_bool("HTTPS", False)
if HTTPS and not env_str("SECRET_KEY"):
    raise ImproperlyConfigured("HTTPS=1 is a production setting: set SECRET_KEY too")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", HTTPS)
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", HTTPS)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", HTTPS)
if env_bool("SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "template_partials",
    # django-ninja: the JSON API under /api/; listed so its docs page serves Swagger UI
    # from the package's static files, never a CDN.
    "ninja",
    # Login throttling: failed logins counted per username and address (django-axes).
    "axes",
    "research",
    "reviews",
    "webhooks",
]

MIDDLEWARE = [
    # First, so its Server-Timing header covers every other middleware and the view.
    "config.server_timing.server_timing",
    "django.middleware.security.SecurityMiddleware",
    "config.csp.content_security_policy",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into its 429 response.
    "axes.middleware.AxesMiddleware",
]

# Every password login (the app's and the admin's) passes django-axes first: after
# AXES_FAILURE_LIMIT wrong passwords for one username from one address, that pair is
# refused for AXES_COOLOFF_TIME hours, the right password included. API tokens are not
# passwords and have their own rate limit (RATE_LIMITS).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = 0.25  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# How many reverse proxies in front of the app append to X-Forwarded-For (0: served
# directly). Behind a TLS proxy every login comes from the proxy's address; with this
# set, the address the outermost proxy saw is counted (config/client_address.py).
TRUSTED_PROXIES = env_int("TRUSTED_PROXIES", 0)
AXES_CLIENT_IP_CALLABLE = "config.client_address.client_address"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # no banner on stdout, where commands write their JSON
AXES_HTTP_RESPONSE_CODE = 429
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = "config.wsgi.application"

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
                "reviews.context_processors.review_queue",
            ],
        },
    },
]


def _database() -> dict:
    url = env_str("DATABASE_URL")
    if url:
        max_age = env_int("DB_CONN_MAX_AGE", 60)
        database = dj_database_url.parse(url, conn_max_age=max_age, conn_health_checks=max_age > 0)
        pool_max = env_int("DB_POOL_MAX", 0)
        if pool_max and max_age == 0 and database["ENGINE"] == "django.db.backends.postgresql":
            # The web processes (config.asgi) keep no connection past a request, but a
            # new PostgreSQL connection per request cost 3.5 ms of the machine's CPU
            # (a backend forked and set up) against 0.1 ms for one borrowed from a pool
            # (docs/benchmarks.md, "A pool of connections"). The pool is per process and
            # bounded, so 20 users of several processes stay well inside PostgreSQL's
            # 100 connections; a request waits for a free one instead.
            database.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": pool_max, "timeout": 30}
        return database
    private_data_dir(DATA_DIR, DATA_DIR / "db.sqlite3")
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DATA_DIR / "db.sqlite3",
        "OPTIONS": {
            # WAL lets the web process read while a worker writes; IMMEDIATE makes a
            # writer take the lock up front instead of failing half-way on upgrade.
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
        },
        # A file, not the in-memory default: worker threads in the tests need a database
        # that waits on locks like the real one does.
        "TEST": {"NAME": str(DATA_DIR / "test.sqlite3")},
    }


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The embedded Redis started by config.launch exports REDIS_URL to its children, and
# tells commands run by hand beside it through DATA_DIR (config.launcher_state), so
# every process of one installation agrees on the server.
_LAUNCHER = launcher_state.read(DATA_DIR)
REDIS_URL = env_str("REDIS_URL") or _LAUNCHER.get("redis_url") or "redis://127.0.0.1:6379/0"
CHANNEL_PREFIX = env_str("CHANNEL_PREFIX", "kl")

# Shared by every web process when there is a Redis to share (the rate limits count
# across processes); a process's own memory otherwise (manage.py without a server).
CACHES = {"default": {
    "BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
    "KEY_PREFIX": CHANNEL_PREFIX,
} if env_str("REDIS_URL") or _LAUNCHER.get("redis_url") else {
    "BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# Rate limits per user and action (config.ratelimit): "COUNT/PERIOD", PERIOD one of
# s, m, h, d (optionally with a number, "100/10m"). Over the limit is a 429.
# Endpoints one user may have: every event owes a delivery (and its retries) to each.
WEBHOOK_ENDPOINTS_PER_USER = env_int("WEBHOOK_ENDPOINTS_PER_USER", 10)

RATE_LIMITS = {
    "thesis-submit": env_str("RATE_LIMIT_THESIS_SUBMIT", "20/h"),
    "sweep-start": env_str("RATE_LIMIT_SWEEP_START", "30/h"),
    "candidate-decide": env_str("RATE_LIMIT_CANDIDATE_DECIDE", "60/h"),
    # Each verification is a worker's evaluation.
    "candidate-verify": env_str("RATE_LIMIT_CANDIDATE_VERIFY", "20/h"),
    "api-post": env_str("RATE_LIMIT_API_POST", "120/h"),
    "api-token-create": env_str("RATE_LIMIT_API_TOKEN_CREATE", "20/h"),
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            # No read timeout: the layer's receive blocks on Redis for 5 s at a time, and
            # redis-py 8's default 5 s timeout would end every idle websocket with 1011.
            "hosts": [{"address": REDIS_URL, "socket_timeout": None}],
            "prefix": CHANNEL_PREFIX,
            # Every websocket of one Daphne process shares one Redis queue: 50 pages on a
            # sweep at 20 events/s is 1,000 messages a second into it. A full queue drops
            # pushes (the consumers then catch up from the database, research.consumers).
            "capacity": 5000,
        },
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A task is acknowledged only after it ran, and goes back to the queue if its worker
# dies, so no evaluation is lost; the claim in the service keeps it from running twice.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
# Webhook deliveries have a queue of their own, served by a worker of their own in the
# quick start: a receiver that is slow or down (12 attempts each, a fan-out of many
# endpoints) never waits behind evaluations, nor they behind it.
WEBHOOKS_QUEUE = "webhooks"
CELERY_TASK_ROUTES = {"webhooks.tasks.*": {"queue": WEBHOOKS_QUEUE}}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Longer than any evaluation may run, so Redis never redelivers a task still running.
CANDIDATE_TIME_LIMIT_S = env_int("CANDIDATE_TIME_LIMIT_S", 900)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CANDIDATE_TIME_LIMIT_S * 2}
# Work owed for this long with its queue drained lost its message and is sent again;
# every worker looks every RECOVER_EVERY_S (0: never) (research.recovery).
RECOVER_AFTER_S = env_int("RECOVER_AFTER_S", 120)
RECOVER_EVERY_S = env_int("RECOVER_EVERY_S", 60)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
STATICFILES_DIRS = [
    BASE_DIR / "static",
    # plotly.js as shipped inside the plotly package: served locally, never from a CDN.
    ("plotly", Path(find_spec("plotly").submodule_search_locations[0]) / "package_data"),
]
MEDIA_ROOT = DATA_DIR / "media"
MEDIA_URL = "media/"

# Uploads above this are refused before they are parsed or stored.
EVIDENCE_MAX_BYTES = env_int("EVIDENCE_MAX_BYTES", 25 * 1024 * 1024)
# Results files from remote GPU hosts (POST /api/theses/ID/results, manage.py import_results).
RESULTS_MAX_BYTES = env_int("RESULTS_MAX_BYTES", 64 * 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024
# No request body is read past this (config.request_limits): the largest upload allowed,
# with room for a multipart form's other fields.
REQUEST_MAX_BYTES = max(EVIDENCE_MAX_BYTES, RESULTS_MAX_BYTES) + 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024

# The kernel workspace: a git repository (bare: written only through git's plumbing)
# holding every op's kept kernel, the dispatch table and one branch per candidate.
KERNEL_WORKSPACE = Path(env_str("KERNEL_WORKSPACE", str(DATA_DIR / "workspace")))

# Candidate evaluations run the harness in a child process with this interpreter.
HARNESS_PYTHON = env_str("HARNESS_PYTHON", "")
HARNESS_TIME_BUDGET_S = float(env_str("HARNESS_TIME_BUDGET_S", "1.0"))
# Users' own end-to-end programs, op name -> command line, from the TOML file named by
# E2E_COMMANDS_FILE (docs/harness.md, "Your own end-to-end command"): every evaluation of the op
# runs its command with the kept kernel and with the candidate.
E2E_COMMANDS = env_toml_strings("E2E_COMMANDS_FILE")
# Coding agents an agent sweep may run, name -> command line (or a table that also says
# what its jail lets it reach: research.agent_jail), from the TOML file named by
# AGENT_COMMANDS_FILE: the sweep form offers these names only, never a free-text command.
# Each proposal runs jailed in a scratch clone of the kernel workspace, stopped after
# AGENT_TIME_LIMIT_S seconds (docs/agents.md).
AGENT_COMMANDS = env_toml_table("AGENT_COMMANDS_FILE")
AGENT_TIME_LIMIT_S = env_int("AGENT_TIME_LIMIT_S", 600)
# The largest file an agent may write (RLIMIT_FSIZE): its clone lies on the worker's own
# disk, and the worker's git then reads and copies every byte of it.
AGENT_MAX_FILE_BYTES = env_int("AGENT_MAX_FILE_BYTES", 256 * 1024 * 1024)
# Whether an agent's declared hosts may resolve to loopback or private addresses
# (research/agent_egress.py). Never in production: the tests' stand-in for a model's API
# listens on loopback.
AGENT_EGRESS_ALLOW_PRIVATE = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}

# The quick start has no separate web server for static files: Daphne serves them.
SERVE_STATIC = env_bool("SERVE_STATIC", True)

# Webhooks (PRODUCT §7). The public address of this installation, for links in payloads.
SITE_URL = env_str("SITE_URL") or _LAUNCHER.get("site_url") or "http://127.0.0.1:8000"
WEBHOOKS_TIMEOUT_S = 15
# A failed attempt is retried after about BASE·2^(n-1) seconds (jittered, at most CAP),
# up to MAX_ATTEMPTS attempts in all: by default over about two hours. The cap stays
# under the broker's visibility timeout, so a retry waiting in a worker is not handed
# out a second time.
WEBHOOKS_MAX_ATTEMPTS = env_int("WEBHOOKS_MAX_ATTEMPTS", 12)
WEBHOOKS_RETRY_BASE_S = float(env_str("WEBHOOKS_RETRY_BASE_S", "30"))
WEBHOOKS_RETRY_CAP_S = float(env_str("WEBHOOKS_RETRY_CAP_S", "1200"))
# A delivery due for this long has lost its message; a worker enqueues it again.
WEBHOOKS_RECOVER_AFTER_S = float(env_str("WEBHOOKS_RECOVER_AFTER_S", "300"))
# Off: webhooks cannot reach loopback, private, link-local or other non-public
# addresses, so a URL cannot be used to probe the internal network (SSRF).
WEBHOOKS_ALLOW_PRIVATE_NETWORKS = env_bool("WEBHOOKS_ALLOW_PRIVATE_NETWORKS", False)
