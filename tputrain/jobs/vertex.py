"""Vertex AI CustomJobs that train a gin config on a TPU or GPU, validated offline.

`build_job` returns the CustomJob REST body (`displayName` and
`jobSpec.workerPoolSpecs`) whose container runs `python -m tputrain.run` with
the gin files; `tpu_hardware`/`gpu_hardware` pick the machine spec,
`validate_config` parses the config here and checks it fits the job, and
`submit` sends it with google-cloud-aiplatform, which is only needed (and only
imported) then. `tputrain vertex-spec` (tputrain/cli/vertex_spec.py) drives them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Sequence


from tputrain.config.parsing import ConfigError, bound_or, clear_config, parse_gin, require_bound

_CONTAINER_COMMAND = ["python", "-m", "tputrain.run"]
# Vertex AI machine specs for TPU slices, named as Cloud TPU names them
# (`gcloud compute tpus accelerator-types list`). v2/v3 use the "cloud-tpu" machine
# with 8 cores; v5e/v6e use TPU VM machine types, multi-host slices a tpuTopology.
_V5E_V6E_TOPOLOGY = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                     128: "8x16", 256: "16x16"}
_GPU_ALIASES = {"t4": "NVIDIA_TESLA_T4", "v100": "NVIDIA_TESLA_V100", "p100": "NVIDIA_TESLA_P100",
                "p4": "NVIDIA_TESLA_P4", "a100": "NVIDIA_TESLA_A100",
                "a100-80gb": "NVIDIA_A100_80GB", "l4": "NVIDIA_L4", "h100": "NVIDIA_H100_80GB"}
# Default machine type per GPU count (Compute Engine's fixed GPU-to-machine pairings).
_GPU_MACHINES = {
    "NVIDIA_TESLA_T4": {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"},
    "NVIDIA_TESLA_V100": {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32",
                          8: "n1-standard-64"},
    "NVIDIA_TESLA_P100": {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"},
    "NVIDIA_TESLA_P4": {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"},
    "NVIDIA_TESLA_A100": {1: "a2-highgpu-1g", 2: "a2-highgpu-2g", 4: "a2-highgpu-4g",
                          8: "a2-highgpu-8g", 16: "a2-megagpu-16g"},
    "NVIDIA_A100_80GB": {1: "a2-ultragpu-1g", 2: "a2-ultragpu-2g", 4: "a2-ultragpu-4g",
                         8: "a2-ultragpu-8g"},
    "NVIDIA_L4": {1: "g2-standard-8", 2: "g2-standard-24", 4: "g2-standard-48",
                  8: "g2-standard-96"},
    "NVIDIA_H100_80GB": {8: "a3-highgpu-8g"},
}
_IMAGE = re.compile(r"^(?:[a-z0-9.-]+(?::\d+)?/)?[a-z0-9._-]+(?:/[a-z0-9._-]+)*"
                    r"(?::[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})?$")
_BUCKET = re.compile(r"^gs://([a-z0-9][a-z0-9._-]{1,61}[a-z0-9])(/.*)?$")
_DISPLAY_NAME_MAX = 128
# Per-replica batches that fill TPU matrix units (128 wide on v2-v5e).
_TPU_BATCH_MULTIPLE = 128


class SpecError(ValueError):
    """The job cannot be built as asked; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One worker pool's machine and the TF replicas it gives."""

    machine_spec: dict[str, Any]
    replicas_per_machine: int  # num_replicas_in_sync of one machine (TPU: of the slice)
    kind: str  # "tpu", "gpu" or "cpu"


def tpu_hardware(accelerator: str, machine_type: str | None = None,
                 topology: str | None = None) -> Hardware:
    """The machine spec for a Cloud TPU name such as "v5litepod-8", "v3-8" or "v6e-16".

    One TF replica per TensorCore: v2/v3 have two per chip ("v3-8" is 4 chips,
    8 replicas); v5e and v6e have one ("v5litepod-8" is 8 chips, 8 replicas).
    Slices above 8 chips span several hosts (4 chips each) and are one pool with
    a `tpuTopology`. `machine_type`/`topology` override the table.
    """
    match = re.fullmatch(r"(v2|v3|v5litepod|v6e)-(\d+)", accelerator)
    if not match:
        raise SpecError(f"--tpu={accelerator!r} is not a supported TPU: use v2-8, v3-8, "
                        f"v5litepod-N or v6e-N with N in {sorted(_V5E_V6E_TOPOLOGY)} "
                        "(or pass --machine_type and --tpu_topology yourself)")
    version, count = match.group(1), int(match.group(2))
    if version in ("v2", "v3"):
        if count != 8:
            raise SpecError(f"--tpu={accelerator}: Vertex AI runs {version} as one 8-core "
                            f"machine: use --tpu={version}-8")
        spec = {"machineType": machine_type or "cloud-tpu",
                "acceleratorType": f"TPU_{version.upper()}", "acceleratorCount": 8}
        return Hardware(spec, replicas_per_machine=8, kind="tpu")
    if count not in _V5E_V6E_TOPOLOGY and not topology:
        raise SpecError(f"--tpu={accelerator}: {version} slices have "
                        f"{', '.join(map(str, sorted(_V5E_V6E_TOPOLOGY)))} chips")
    per_host = count if count <= 8 else 4
    prefix = "ct5lp-hightpu" if version == "v5litepod" else "ct6e-standard"
    spec = {"machineType": machine_type or f"{prefix}-{per_host}t",
            "tpuTopology": topology or _V5E_V6E_TOPOLOGY[count]}
    return Hardware(spec, replicas_per_machine=count, kind="tpu")


def gpu_hardware(gpu: str, count: int = 1, machine_type: str | None = None) -> Hardware:
    """The machine spec for `count` GPUs of type `gpu` (an alias like "a100" or the enum)."""
    accelerator = _GPU_ALIASES.get(gpu.lower(), gpu.upper())
    if accelerator not in _GPU_MACHINES:
        raise SpecError(f"--gpu={gpu!r} is not a known Vertex AI GPU: use one of "
                        f"{', '.join(sorted(_GPU_ALIASES))} or {', '.join(sorted(_GPU_MACHINES))}")
    machines = _GPU_MACHINES[accelerator]
    if count < 1:
        raise SpecError(f"--gpu_count must be >= 1, got {count}")
    if machine_type is None and count not in machines:
        raise SpecError(f"{accelerator} comes {' or '.join(map(str, sorted(machines)))} per "
                        f"machine, not {count}: change --gpu_count (or pass --machine_type)")
    spec = {"machineType": machine_type or machines[count], "acceleratorType": accelerator,
            "acceleratorCount": count}
    return Hardware(spec, replicas_per_machine=count, kind="gpu")


def check_image(image: str) -> None:
    if not image:
        raise SpecError("--image is required: the container image that has tputrain and your "
                        "code installed, e.g. us-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG")
    if not _IMAGE.match(image):
        raise SpecError(f"--image={image!r} is not a container image reference: use "
                        "HOST/PATH/IMAGE[:TAG|@sha256:DIGEST] in lower case, e.g. "
                        "us-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG")


def check_bucket(bucket: str, flag: str = "--bucket") -> None:
    if not bucket:
        raise SpecError(f"{flag} is required: a gs:// location for checkpoints and logs, "
                        "e.g. gs://my-bucket/tputrain")
    if not _BUCKET.match(bucket):
        raise SpecError(f"{flag}={bucket!r} is not a Cloud Storage path: use gs://BUCKET[/PREFIX] "
                        "with a bucket name of 3-63 lower-case letters, digits, '-', '_' or '.'")


def container_args(gin_files: Sequence[str], gin_params: Sequence[str],
                   gin_search_paths: Sequence[str], gin_imports: Sequence[str],
                   model_dir: str) -> list[str]:
    """The `python -m tputrain.run` flags the container gets (paths passed unchanged)."""
    args = [f"--gin_file={f}" for f in gin_files]
    args += [f"--gin_search_path={p}" for p in gin_search_paths]
    args += [f"--gin_import={m}" for m in gin_imports]
    args += [f"--gin_param={p}" for p in gin_params]
    return args + [f"--model_dir={model_dir}"]


def build_job(*, display_name: str, image: str, bucket: str, hardware: Hardware,
              args: Sequence[str], replica_count: int = 1, spot: bool = False) -> dict[str, Any]:
    """The CustomJob REST body (`projects.locations.customJobs.create`).

    Several GPU machines become two worker pools, one primary and the rest workers;
    Vertex AI then sets TF_CONFIG on each, which `resolve_strategy` turns into a
    MultiWorkerMirroredStrategy. A TPU slice is always one pool of one replica.
    """
    check_image(image)
    check_bucket(bucket)
    if not display_name or len(display_name) > _DISPLAY_NAME_MAX:
        raise SpecError(f"--display_name must have 1 to {_DISPLAY_NAME_MAX} characters, "
                        f"got {len(display_name)}")
    if replica_count < 1:
        raise SpecError(f"--replica_count must be >= 1, got {replica_count}")
    if hardware.kind == "tpu" and replica_count != 1:
        raise SpecError("--replica_count must be 1 for a TPU job: pick a larger slice "
                        "(e.g. --tpu=v5litepod-16) for more chips")
    container = {"imageUri": image, "command": list(_CONTAINER_COMMAND), "args": list(args)}
    pool = {"machineSpec": dict(hardware.machine_spec), "replicaCount": 1,
            "containerSpec": container}
    pools = [pool]
    if replica_count > 1:
        pools.append({**pool, "replicaCount": replica_count - 1})
    job_spec: dict[str, Any] = {
        "workerPoolSpecs": pools,
        "baseOutputDirectory": {"outputUriPrefix": f"{bucket.rstrip('/')}/{display_name}"},
    }
    if spot:
        job_spec["scheduling"] = {"strategy": "SPOT"}
    return {"displayName": display_name, "jobSpec": job_spec}


def num_replicas(hardware: Hardware, replica_count: int) -> int:
    return hardware.replicas_per_machine * replica_count


def validate_config(gin_files: Sequence[str], gin_params: Sequence[str],
                    gin_search_paths: Sequence[str], gin_imports: Sequence[str],
                    replicas: int, kind: str) -> list[str]:
    """Parses the gin config here and checks it fits the job; returns warnings.

    Raises `SpecError` for what would fail on Vertex AI: an unparsable config, an
    unbound `Trainer.task`, a global batch not divisible by the replicas, or a
    forced strategy that contradicts the hardware.
    """
    warnings = []
    for path in gin_files:
        if os.path.isabs(path):
            warnings.append(f"--gin_file={path} is an absolute path: it must exist at that "
                            "path inside the image too")
    try:
        parse_gin(gin_files, gin_params, gin_search_paths, gin_imports, finalize=False)
        require_bound("Trainer.task")
        global_batch = bound_or("Trainer.global_batch_size", 64)
        forced = bound_or("resolve_strategy.strategy", None)
        precision = bound_or("Trainer.precision", None)
    except ConfigError as error:
        raise SpecError(f"the gin config does not parse: {error}") from error
    finally:
        clear_config()
    if global_batch % replicas:
        multiple = replicas * max(1, round(global_batch / replicas))
        raise SpecError(f"Trainer.global_batch_size={global_batch} is not divisible by the "
                        f"{replicas} replicas of this job: use a multiple of {replicas} "
                        f"(e.g. --gin_param=Trainer.global_batch_size={multiple})")
    expected = {"tpu": ("tpu",), "gpu": ("mirrored", "one_device", "multi_worker"),
                "cpu": ("cpu", "one_device", "multi_worker")}[kind]
    if forced is not None and forced not in expected:
        raise SpecError(f"the config forces resolve_strategy.strategy={forced!r} but this is a "
                        f"{kind.upper()} job: remove the binding (tputrain picks the strategy) "
                        f"or use one of {expected}")
    per_replica = global_batch // replicas
    if kind == "tpu" and per_replica % _TPU_BATCH_MULTIPLE:
        warnings.append(f"per-replica batch {per_replica} (global {global_batch} / {replicas} "
                        f"replicas) is not a multiple of {_TPU_BATCH_MULTIPLE}: TPU matrix units "
                        f"are {_TPU_BATCH_MULTIPLE} wide, so part of each is idle")
    if kind == "tpu" and precision == "mixed_float16":
        warnings.append("Trainer.precision='mixed_float16' on a TPU: TPUs compute in bfloat16; "
                        "use 'mixed_bfloat16' (or leave it unset)")
    return warnings


def job_service(project: str, region: str, guide: str = "docs/vertex.md") -> tuple[Any, Any]:
    """(the `aiplatform_v1` module, a JobServiceClient for `region`): what `--submit`
    needs, or a SpecError that names the fix (`guide`: where the printed JSON is explained)."""
    try:
        from google.cloud import aiplatform_v1  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise SpecError("--submit needs google-cloud-aiplatform: pip install "
                        "google-cloud-aiplatform, or submit the printed JSON yourself "
                        f"(see {guide})") from error
    if not project:
        raise SpecError("--submit needs --project=YOUR_GCP_PROJECT")
    return aiplatform_v1, aiplatform_v1.JobServiceClient(
        client_options={"api_endpoint": f"{region}-aiplatform.googleapis.com"})


def submit(job: dict[str, Any], project: str, region: str) -> str:
    """Creates the CustomJob with google-cloud-aiplatform; returns its resource name."""
    aiplatform_v1, client = job_service(project, region)
    custom_job = aiplatform_v1.CustomJob.from_json(json.dumps(job))
    created = client.create_custom_job(parent=f"projects/{project}/locations/{region}",
                                       custom_job=custom_job)
    return created.name


def default_display_name(gin_files: Sequence[str]) -> str:
    """tputrain-<first gin file>, in the letters Vertex AI job names allow."""
    stem = os.path.splitext(os.path.basename(gin_files[0]))[0] if gin_files else "job"
    return re.sub(r"[^a-z0-9-]+", "-", f"tputrain-{stem}".lower()).strip("-")
