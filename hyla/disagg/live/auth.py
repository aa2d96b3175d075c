"""Where a cluster's secrets come from: environment variables or files, never a command line
(which every user of the machine can read in ``ps``).

- the API key (clients -> router, router -> workers): ``$HYLA_API_KEY`` or
  ``--api-key-file PATH`` (``hyla serve``, ``hyla cluster``);
- the cluster secret, which keys the HMAC on every transfer frame: ``$HYLA_CLUSTER_SECRET``
  or a file named by ``$HYLA_CLUSTER_SECRET_FILE``. ``hyla cluster`` makes a random one for
  its workers; a worker given none derives it from the API key, and with neither the
  transfer channel is unauthenticated (allowed only on a loopback address). The same
  secret signs every call of an ``/internal/*`` HTTP route
  (:mod:`hyla.disagg.live.internal_auth`): with a secret set, unsigned calls get 401.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "key"); _ = open(path, "w").write("s3 \\n")
    >>> read_secret(None, path)
    's3'
"""

from __future__ import annotations

import os
import pathlib

from hyla.disagg.live.transfer.frames import transfer_key


def read_secret(env_value: str | None, path: str | None) -> str | None:
    """The secret in ``path`` (surrounding whitespace stripped) if given, else
    ``env_value``; None if neither. ValueError naming the file if it cannot be read or
    is empty."""
    if path:
        try:
            value = pathlib.Path(path).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file {path!r}: {e.strerror}") from None
        if not value:
            raise ValueError(f"the secret file {path!r} is empty")
        return value
    return env_value or None


def api_key(path: str | None = None) -> str | None:
    """The API key: the file ``path`` (``--api-key-file``), else ``$HYLA_API_KEY``."""
    return read_secret(os.environ.get("HYLA_API_KEY"), path)


def cluster_secret() -> str | None:
    """``$HYLA_CLUSTER_SECRET_FILE``'s content, else ``$HYLA_CLUSTER_SECRET``."""
    return read_secret(os.environ.get("HYLA_CLUSTER_SECRET"),
                       os.environ.get("HYLA_CLUSTER_SECRET_FILE"))


def worker_transfer_key(api_key_value: str | None, host: str) -> bytes | None:
    """The HMAC key of a worker's transfer channel: from the cluster secret, else from the
    API key; None (unauthenticated) only when the worker binds a loopback address.

    Example:
        >>> worker_transfer_key(None, "127.0.0.1") is None
        True
    """
    secret = cluster_secret() or api_key_value
    if secret is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"binding {host}: set $HYLA_CLUSTER_SECRET (or an API key) so that "
                         "state transfers are authenticated")
    return transfer_key(secret)


def internal_http_key() -> bytes | None:
    """The key that signs ``/internal/*`` HTTP calls: from the cluster secret (None without
    one: then only the API key, if any, guards those routes)."""
    from hyla.disagg.live.internal_auth import internal_key

    return internal_key(cluster_secret())
