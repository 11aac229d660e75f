"""TLS to Redis (``rediss://``): claimkit's verifying defaults, the certificate files
checked before connecting, and a failed handshake explained in one line (docs/security.md)."""

from __future__ import annotations

import logging
import os
import ssl
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from claimkit.store.interface import StoreTlsError
from claimkit.store.redact import redact_url

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "CLIENT_CERT_HINT",
    "tls_file_error",
    "tls_file_problem",
    "tls_problem",
    "tls_settings",
]

# OpenSSL's verify codes (X509_V_ERR_*) for a server certificate the client refused.
_UNTRUSTED = {2, 18, 19, 20, 21, 27}
_CA_HINT = "pass the CA that signed it with ?ssl_ca_certs=<ca.pem>"
_CLIENT_CERT_HINT = "pass one with ?ssl_certfile=<cert.pem>&ssl_keyfile=<key.pem>"
# OpenSSL's reasons for a handshake the server ended with an alert.
_CERT_REQUIRED = f"the server requires a client certificate: {_CLIENT_CERT_HINT}"
_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": _CERT_REQUIRED,
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": _CERT_REQUIRED,
    "SSLV3_ALERT_BAD_CERTIFICATE": "the server refused this client's certificate (bad certificate)",
    "TLSV1_ALERT_UNKNOWN_CA": "the server does not trust the CA of this client's certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the server refused this client's certificate: expired",
    "WRONG_VERSION_NUMBER": "the server does not speak TLS on this port (plain: use redis://)",
}
CLIENT_CERT_HINT = (
    "a rediss:// server that requires client certificates (tls-auth-clients yes) drops a "
    f"client without one like this: {_CLIENT_CERT_HINT}"
)
"""Said with a lost connection to a ``rediss://`` URL that names no client certificate:
under TLS 1.3 the server's alert may be lost in the reset that follows it."""
_log = logging.getLogger("claimkit")
_WARNED: set[str] = set()


def tls_settings(url: str) -> str:
    """``url`` with claimkit's TLS defaults made explicit, warning once per URL (one
    ``WARNING`` log line) when it turns verification off.

    For ``rediss://`` both clients then verify the server's certificate and host name:
    ``ssl_cert_reqs=required`` and ``ssl_check_hostname=true`` unless the URL says
    otherwise (coredis's own defaults verify neither the host name nor a missing
    certificate). Other URLs are returned as they are.
    """
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return url
    query = {k.lower(): v[-1].lower() for k, v in parse_qs(parts.query).items()}
    reqs = query.get("ssl_cert_reqs")
    off = []
    if reqs in ("none", "cert_none", "optional", "cert_optional"):
        off.append(f"ssl_cert_reqs={reqs} turns certificate verification off")
    if query.get("ssl_check_hostname") in ("false", "0", "no", "n", "off"):
        off.append("ssl_check_hostname=false turns the host-name check off")
    if off and url not in _WARNED:
        _WARNED.add(url)
        _log.warning(
            "claimkit: warning: %s for %s: anyone on the network path can pose as this "
            "Redis; pass the server's CA with ?ssl_ca_certs=<ca.pem> instead (docs/security.md)",
            " and ".join(off),
            redact_url(url),
        )
    extra = []
    if reqs is None:
        extra.append("ssl_cert_reqs=required")
        reqs = "required"
    if "ssl_check_hostname" not in query and reqs in ("required", "cert_required"):
        extra.append("ssl_check_hostname=true")
    if not extra:
        return url
    joined = "&".join(extra)
    return parts._replace(query=f"{parts.query}&{joined}" if parts.query else joined).geturl()


def _tls_files(url: str) -> dict[str, str]:
    """The TLS file parameters of ``url`` (lower-case name -> path), the last of each."""
    query = {k.lower(): v[-1] for k, v in parse_qs(urlsplit(url).query).items()}
    return {name: query[name] for name in _TLS_FILES if query.get(name)}


_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _unreadable(name: str, path: str) -> str | None:
    """Why the file parameter ``name`` cannot be read, or ``None`` when it can."""
    try:
        if os.path.isdir(path):
            if name != "ssl_ca_certs":
                return f"{name} {path} is a directory, not a file"
            os.listdir(path)
        else:
            with open(path, "rb"):
                pass
    except FileNotFoundError:
        return f"{name} {path}: no such file"
    except PermissionError:
        return f"{name} {path} cannot be read: permission denied"
    except OSError as exc:
        return f"{name} {path} cannot be read: {exc.strerror or exc}"
    return None


def _holds_key(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"PRIVATE KEY-----" in f.read()
    except OSError:
        return False


def _no_certificate(name: str, path: str) -> str:
    hint = " (is it the key?)" if _holds_key(path) else ""
    return f"{name} {path} holds no certificate{hint}"


def tls_file_problem(url: str) -> str | None:
    """One line naming what is wrong with a TLS file the ``rediss://`` ``url`` names, or
    ``None`` when every one loads.

    Each of ``ssl_ca_certs`` (a PEM file or a directory of them), ``ssl_certfile`` and
    ``ssl_keyfile`` must exist and be readable, and an :class:`ssl.SSLContext` must accept
    them: the CA as verify locations, the client certificate and its key as one chain.
    Only files are read: nothing connects.
    """
    files = _tls_files(url)
    for name, path in files.items():
        problem = _unreadable(name, path)
        if problem is not None:
            return problem
    ca = files.get("ssl_ca_certs")
    if ca is not None:
        try:
            where = "capath" if os.path.isdir(ca) else "cafile"
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(**{where: ca})
        except (ssl.SSLError, OSError):
            return _no_certificate("ssl_ca_certs", ca)
    cert, key = files.get("ssl_certfile"), files.get("ssl_keyfile")
    if cert is None:
        if key is not None:
            return f"ssl_keyfile {key} needs its certificate: pass ssl_certfile"
        return None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except (ssl.SSLError, OSError):
        return _no_certificate("ssl_certfile", cert)
    try:
        # A callable password: an encrypted key fails here instead of prompting on a tty.
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError):
        if key is None:
            return f"ssl_certfile {cert} holds no private key: pass ssl_keyfile"
        return f"ssl_certfile {cert} and ssl_keyfile {key} do not form a certificate and its key"
    if key is None:
        # coredis sends no certificate without ssl_keyfile, even from a file holding both.
        return f"ssl_certfile {cert} needs ssl_keyfile too: pass ssl_keyfile={cert}"
    return None


def tls_file_error(url: str) -> StoreTlsError | None:
    """A :class:`StoreTlsError` naming a TLS file of ``url`` that fails to load now, or
    ``None`` when every one loads (or ``url`` names none).

    For a failed connection: the clients load the files when they build their TLS context,
    and a file may have changed since :func:`check_url`. A bad file does not always show as
    a TLS error (coredis skips an ``ssl_certfile`` without ``ssl_keyfile``, and under TLS 1.3
    the server's alert may be lost in the reset after it), so the files are read again on
    any connection error of a ``rediss://`` URL that names one.
    """
    if urlsplit(url).scheme != "rediss" or not _tls_files(url):
        return None
    problem = tls_file_problem(url)
    return None if problem is None else StoreTlsError(problem)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything it was raised from, inside exception groups too."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            todo += list(current.exceptions)


def tls_problem(exc: BaseException) -> str | None:
    """One line naming the certificate (or TLS) problem behind a failed connection, or
    ``None`` when ``exc`` was not caused by one."""
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            code, text = cause.verify_code, cause.verify_message
            if code in _UNTRUSTED:
                return (
                    "TLS certificate problem: the server's certificate is not signed by a CA "
                    f"this client trusts ({text}): {_CA_HINT}"
                )
            if code == 62 or "Hostname mismatch" in str(text) or "IP address mismatch" in str(text):
                return (
                    "TLS certificate problem: the server's certificate is not valid for the "
                    f"URL's host ({text}): connect by a name the certificate holds"
                )
            if code == 10:
                return f"TLS certificate problem: the server's certificate has expired ({text})"
            if code == 9:
                return (
                    f"TLS certificate problem: the server's certificate is not yet valid ({text})"
                )
            return f"TLS certificate problem: the server's certificate was refused ({text})"
        if isinstance(cause, ssl.SSLError):
            reason = str(cause.reason or "")
            explained = _ALERTS.get(reason)
            if explained is not None:
                return f"TLS problem: {explained} ({reason})"
            return f"TLS handshake failed: {cause}"
    return None
