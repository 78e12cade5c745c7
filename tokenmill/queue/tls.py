"""TLS for tokenmill's Redis URLs: `rediss://` always means TLS with the server's certificate verified.

Left to themselves the libraries do not ensure that. Celery hands the broker URL to kombu with
`broker_transport` set to tokenmill's transport, and kombu turns TLS on only for a transport *named*
`rediss` or when `broker_use_ssl` (or an `ssl_*` query parameter) is given: a bare `rediss://` URL then
connected in plaintext and sent the password (`HELLO 3 AUTH ...`) in the clear. With kombu's own `rediss`
transport and no `ssl_*` parameter it uses TLS but skips certificate verification (`CERT_NONE`), and
Celery's Redis result backend refuses a `rediss://` URL without `ssl_cert_reqs` outright.

So every tokenmill Redis connection takes its TLS options from `redis_tls(url)`: the URL without its
`ssl_*` query parameters, plus redis-py `SSLConnection` options (`ssl_cert_reqs=CERT_REQUIRED`, host name
checked, the CA from `ssl_ca_certs`/`ssl_ca_path`, else the system store, a client certificate from
`ssl_certfile`/`ssl_keyfile`), which Celery gets as `broker_use_ssl` and `redis_backend_use_ssl` and
redis-py as keyword arguments. `check_redis_url` refuses what would weaken that (`ssl_cert_reqs` other
than required, `ssl_check_hostname=false`, `ssl_*` parameters on a plain `redis://` URL, unknown `ssl_*`
parameters) with an error naming the parameter. Torch-free.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from tokenmill.queue.packing import PACKER_OPTIONS

TLS_SCHEME = "rediss"
#: `ssl_*` query parameters passed on to redis-py's `SSLConnection` unchanged (paths, a key password, ciphers).
_PASSED_ON = frozenset({"ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_ciphers"})
#: Accepted only with the value that keeps verification on (kombu's and Celery's spellings).
_VERIFYING = {"ssl_cert_reqs": {"required", "cert_required"}, "ssl_check_hostname": {"true", "1", "yes"}}


def check_redis_url(url: str) -> str:
    """`url` if its TLS parameters are acceptable; a ValueError naming the parameter otherwise."""
    parts = urlsplit(url)
    tls_params = [(key, value) for key, value in parse_qsl(parts.query, keep_blank_values=True) if key.startswith("ssl_")]
    if tls_params and parts.scheme != TLS_SCHEME:
        raise ValueError(f"{tls_params[0][0]} needs a rediss:// URL (TLS); this one is {parts.scheme}://")
    for key, value in tls_params:
        if key in _VERIFYING:
            if value.lower() not in _VERIFYING[key]:
                raise ValueError(f"{key}={value} would turn certificate verification off; tokenmill always verifies "
                                 "the server over rediss:// (give its CA with ssl_ca_certs=/path/to/ca.pem)")
        elif key not in _PASSED_ON:
            known = ", ".join(sorted({*_PASSED_ON, *_VERIFYING}))
            raise ValueError(f"unknown TLS parameter {key} in the Redis URL (known: {known})")
    return url


def redis_tls(url: str) -> tuple[str, dict[str, Any] | None]:
    """The URL without `ssl_*` parameters, and redis-py SSL options for it (None for a plain `redis://` URL)."""
    parts = urlsplit(check_redis_url(url))
    query = parse_qsl(parts.query, keep_blank_values=True)
    bare = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if not k.startswith("ssl_")])))
    if parts.scheme != TLS_SCHEME:
        return bare, None
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True}
    options.update((key, value) for key, value in query if key in _PASSED_ON)
    return bare, options


def redis_client(url: str, max_connections: int | None = None, pool_timeout: float = 30.0,
                 **options: Any) -> redis.Redis:
    """A redis-py client for `url` with the TLS options above and hiredis's packing (`tokenmill.queue.packing`), for
    tokenmill's own keys beside Celery's. With `max_connections`, its pool holds at most that many and a call finding
    them all taken waits for one, `pool_timeout` seconds at most, then raises `ConnectionError` (redis-py's
    `BlockingConnectionPool`; its default pool raises `MaxConnectionsError` at once, past 100)."""
    bare, tls = redis_tls(url)
    if max_connections is None:
        return redis.Redis.from_url(bare, **PACKER_OPTIONS, **(tls or {}), **options)
    pool = redis.BlockingConnectionPool.from_url(bare, max_connections=max_connections, timeout=pool_timeout,
                                                 **PACKER_OPTIONS, **(tls or {}), **options)
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # closed with the client, as `from_url`'s
    return client
