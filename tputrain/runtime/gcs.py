"""Google Cloud Storage: the object operations `tf.io.gfile` lacks.

Checkpoints, summaries and data on gs:// go through `tf.io.gfile` (TensorFlow's
own GCS filesystem, authenticated with Application Default Credentials). This
module uses `google-cloud-storage` only where a clear answer is needed before
training starts: does the bucket exist, and may this account write to it?
`STORAGE_EMULATOR_HOST` points the client at an emulator (tests).
"""

from __future__ import annotations

import uuid


class BucketError(OSError):
    """The gs:// bucket of a path is missing or not writable."""


def split_gs_path(path: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b')."""
    if not path.startswith("gs://"):
        raise ValueError(f"{path!r} is not a gs:// path")
    bucket, _, prefix = path[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"{path!r} has no bucket name: use gs://BUCKET/path")
    return bucket, prefix.strip("/")


def _client():
    try:
        from google.cloud import storage
    except ImportError as error:  # pragma: no cover - a declared dependency
        raise ImportError("gs:// paths need google-cloud-storage: pip install "
                          "google-cloud-storage") from error
    import os

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="tputrain-test", credentials=AnonymousCredentials())
    return storage.Client()


def check_bucket_writable(path: str) -> None:
    """Writes and deletes a probe object under `path`; raises `BucketError` with the fix.

    A write probe rather than `bucket.exists()`: accounts allowed to write objects
    often may not read bucket metadata.
    """
    from google.api_core import exceptions
    from google.auth import exceptions as auth_exceptions

    bucket_name, prefix = split_gs_path(path)
    name = f"{prefix}/.tputrain-write-test-{uuid.uuid4().hex[:8]}".lstrip("/")
    try:
        blob = _client().bucket(bucket_name).blob(name)
        blob.upload_from_string(b"tputrain", content_type="application/octet-stream")
        blob.delete()
    except auth_exceptions.DefaultCredentialsError as error:
        raise BucketError(f"no Google Cloud credentials to write {path} ({error}): run "
                          "`gcloud auth application-default login` or set "
                          "GOOGLE_APPLICATION_CREDENTIALS") from None
    except exceptions.NotFound:
        raise BucketError(f"bucket gs://{bucket_name} does not exist: create it "
                          f"(`gcloud storage buckets create gs://{bucket_name}`) or fix the "
                          "path") from None
    except exceptions.Forbidden as error:
        raise BucketError(f"no permission to write to gs://{bucket_name} "
                          f"({error.message}): grant this account roles/storage.objectAdmin "
                          "on the bucket, or choose another bucket") from None
