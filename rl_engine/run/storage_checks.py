"""Storage checks before a run: the store answers within seconds, takes the credentials, has the
bucket, and a probe file can be written there; each failure a UserError naming the fix.

Apart from the rest of preflight (rl_engine/run/preflight.py) because creating a run
(`rl_engine.run.context.start_run`) runs the same check before it writes anything: a missing
bucket is an error, never created by a makedirs.

    check_storage("s3://bucket/runs", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:5000"}})
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from rl_engine.errors import UserError
from rl_engine.storage import OUTAGE_KEY, StorageUnavailableError, access_denied, is_local, join, open_storage

# Object stores whose first path component is a bucket (which makedirs would create: never called there).
_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl"}
# How long the checks before a run wait for an object store that does not answer: a dead endpoint
# fails the start in seconds; once the run is going, outages get buffer.storage.outage_timeout_s.
PREFLIGHT_OUTAGE_S = 5.0


def _preflight_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` with the outage limit of the checks before a run (PREFLIGHT_OUTAGE_S, or the run's own if shorter)."""
    from rl_engine.config import StorageConfig

    opts = dict(options or {})
    opts[OUTAGE_KEY] = min(
        float(opts.get(OUTAGE_KEY, StorageConfig.model_fields[OUTAGE_KEY].default)), PREFLIGHT_OUTAGE_S
    )
    return opts


def _endpoint(options: dict[str, Any] | None) -> str:
    """The S3 endpoint that storage options talk to, as a user would name it."""
    given = (
        ((options or {}).get("client_kwargs") or {}).get("endpoint_url")
        or (options or {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    return f"endpoint {given}" if given else "the AWS default endpoint"


def _unreachable_error(url: str, options: dict[str, Any] | None, e: StorageUnavailableError) -> UserError:
    last = f"{type(e.last).__name__}: {str(e.last)[:200]}" if e.last is not None else str(e)[:300]
    limit = (options or {}).get(OUTAGE_KEY)
    return UserError(
        f"buffer.storage.url = {url!r}: the object store at {_endpoint(options)} did not answer within the {_preflight_options(options)[OUTAGE_KEY]:g} s "
        f"the checks before a run wait ({last}); "
        "check that the endpoint (buffer.storage.options.client_kwargs.endpoint_url) is up and reachable from here, or fix buffer.storage.url, then start again "
        f"(a run already going waits out an outage for buffer.storage.outage_timeout_s{f' = {limit:g} s' if limit else ''})"
    )


def _denied_error(url: str, options: dict[str, Any] | None, code: str, e: BaseException) -> UserError:
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    return UserError(
        f"buffer.storage.url = {url!r}: access denied by the object store at {_endpoint(options)} ({code}: {str(e)[:200]}); "
        "check the credentials in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE; "
        f"FSSPEC_S3_KEY / FSSPEC_S3_SECRET) and that they may read and write bucket {bucket!r}"
    )


def check_reachable(url: str, options: dict[str, Any] | None = None) -> None:
    """An object store answers at all, within PREFLIGHT_OUTAGE_S: the first thing a run does with
    its storage, so a dead endpoint fails the start in seconds, not after an outage window per call.
    Local disk and stores without outage retries: nothing to do (their errors come at once)."""
    opts = _preflight_options(options)
    fs, root = open_for_checks(url, opts)
    if not hasattr(fs, "outage_timeout_s"):
        return
    try:
        fs.call_s3("head_bucket", Bucket=root.split("/", 1)[0])
    except StorageUnavailableError as e:
        raise _unreachable_error(url, options, e) from None
    except Exception:  # noqa: BLE001 - it answered (not found, forbidden, ...): check_storage names those
        return


def check_storage(url: str, options: dict[str, Any] | None = None) -> None:
    """`url` opens and a probe file can be written and removed there; on an object store a failed
    probe says whether the store did not answer (within PREFLIGHT_OUTAGE_S), refused the credentials
    (HTTP 403), or has no such bucket (rft never creates buckets: no makedirs there)."""
    fs, root = open_for_checks(url, _preflight_options(options))
    protocols = set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    probe = join(root, f".rft-probe-{uuid.uuid4().hex}")
    try:
        if is_local(fs):
            os.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"probe")
        fs.rm(probe)
    except StorageUnavailableError as e:
        raise _unreachable_error(url, options, e) from None
    except Exception as e:  # noqa: BLE001 - PermissionError, read-only file system, no such bucket, access denied, ...
        error, failure = f"{type(e).__name__}: {e}", e
    else:
        return
    bucket = root.split("/", 1)[0]
    if protocols & _BUCKET_PROTOCOLS and (code := access_denied(failure)):
        raise _denied_error(url, options, code, failure)
    if protocols & _BUCKET_PROTOCOLS and not checked_call(
        fs.exists, bucket, url=url, op=f"look up bucket {bucket!r} ({error})"
    ):
        raise UserError(
            f"buffer.storage.url = {url!r}: bucket {bucket!r} does not exist (rft never creates buckets); "
            f"create it first (e.g. `aws s3 mb s3://{bucket}`, with your endpoint) or fix buffer.storage.url"
        )
    raise UserError(
        f"buffer.storage.url = {url!r}: cannot write there ({error}); "
        "point buffer.storage.url at a directory or bucket you can write to, or fix its permissions"
    )


def open_for_checks(url: str, options: dict[str, Any] | None) -> tuple[Any, str]:
    """(filesystem, root) of `url`; a URL that does not open is a UserError naming buffer.storage.url."""
    try:
        return open_storage(url, options)
    except Exception as e:  # noqa: BLE001 - unknown protocol, missing s3fs, bad options
        raise UserError(
            f"buffer.storage.url = {url!r}: cannot open it ({type(e).__name__}: {e}); use a local directory or an fsspec URL such as s3://bucket/prefix, "
            "with its options in buffer.storage.options"
        ) from None


def checked_call(fn: Any, *args: Any, url: str, op: str) -> Any:
    """`fn(*args)`, its failure a UserError saying which storage operation `op` failed on `url`."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - unreachable endpoint, access denied
        raise UserError(
            f"buffer.storage.url = {url!r}: cannot {op} ({type(e).__name__}: {e}); check the URL, its endpoint and your credentials"
        ) from None
