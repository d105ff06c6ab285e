"""HTTP proxies and the run's own services: loopback traffic never goes through a proxy.

``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``ALL_PROXY`` (either case) send every request of a client that
reads the environment (httpx, requests, urllib, the OpenAI SDK) to the proxy, loopback ones too,
unless ``NO_PROXY`` lists the host. A proxy for the outside world cannot reach this machine's
127.0.0.1 (the executor's health wait never saw its engine healthy), and any proxy would see the
run's token. So:

* Miles' clients of the run's own services (engines, router, session server, the executor's health
  checks) never read the environment (``trust_env=False``; ``miles.http11`` opens sockets itself).
* A client of a URL the user configures (a remote reward server, a model download) follows the
  environment, where a proxy may be what reaches the outside -- except for a loopback URL
  (:func:`is_loopback_url`).
* ``miles train`` adds the loopback names to ``NO_PROXY`` when a proxy is set
  (:func:`keep_loopback_off_proxies`), for the code it runs but Miles does not write: an agent's
  OpenAI client talking to the session server, an SGLang engine's own calls.
"""

from __future__ import annotations

import ipaddress
from collections.abc import MutableMapping
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def is_loopback_url(url: str) -> bool:
    """Whether ``url``'s host is this machine's loopback (``localhost``, 127.0.0.0/8, ``::1``)."""
    return is_loopback_host(urlsplit(url).hostname or "")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, as a URL or a bind setting gives it) is loopback."""
    host = host.lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keep_loopback_off_proxies(environ: MutableMapping[str, str]) -> list[str]:
    """When ``environ`` names a proxy, add the loopback names it lacks to ``NO_PROXY`` and
    ``no_proxy`` (clients read one or the other); returns the names added (none: unchanged)."""
    if not any(environ.get(name) for name in PROXY_VARIABLES):
        return []
    listed: list[str] = []
    for name in ("NO_PROXY", "no_proxy"):
        for item in environ.get(name, "").split(","):
            if item.strip() and item.strip() not in listed:
                listed.append(item.strip())
    if "*" in listed:
        return []
    added = [name for name in LOOPBACK_NAMES if name not in {item.lower() for item in listed}]
    if added:
        environ["NO_PROXY"] = environ["no_proxy"] = ",".join([*listed, *added])
    return added
