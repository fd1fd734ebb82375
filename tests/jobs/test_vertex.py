"""`tputrain vertex-spec`: the CustomJob spec, its offline validation and the CLI."""

import json
import os
import subprocess
import sys

import pytest

from tputrain.jobs import vertex
from tputrain.jobs.vertex import SpecError

IMAGE = "us-docker.pkg.dev/my-project/train/tputrain:1"
BUCKET = "gs://my-bucket/jobs"


def _job(hardware, replica_count=1, **kwargs):
    args = vertex.container_args(["digits.gin"], ["Trainer.train_steps=10"], [], [],
                                 model_dir=f"{BUCKET}/digits/model")
    return vertex.build_job(display_name="digits", image=IMAGE, bucket=BUCKET,
                            hardware=hardware, args=args, replica_count=replica_count, **kwargs)


def test_tpu_v5e_single_host_spec_runs_tputrain_with_the_config():
    hardware = vertex.tpu_hardware("v5litepod-8")
    job = _job(hardware)
    (pool,) = job["jobSpec"]["workerPoolSpecs"]
    assert pool["machineSpec"] == {"machineType": "ct5lp-hightpu-8t", "tpuTopology": "2x4"}
    assert pool["replicaCount"] == 1
    container = pool["containerSpec"]
    assert container["imageUri"] == IMAGE
    assert container["command"] == ["python", "-m", "tputrain.run"]
    assert container["args"] == ["--gin_file=digits.gin", "--gin_param=Trainer.train_steps=10",
                                 f"--model_dir={BUCKET}/digits/model"]
    assert job["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": f"{BUCKET}/digits"}
    assert vertex.num_replicas(hardware, 1) == 8


@pytest.mark.parametrize("accelerator, machine, topology, replicas", [
    ("v5litepod-1", "ct5lp-hightpu-1t", "1x1", 1),
    ("v5litepod-4", "ct5lp-hightpu-4t", "2x2", 4),
    ("v5litepod-16", "ct5lp-hightpu-4t", "4x4", 16),  # 4 hosts of 4 chips, one pool
    ("v5litepod-256", "ct5lp-hightpu-4t", "16x16", 256),
    ("v6e-8", "ct6e-standard-8t", "2x4", 8),
])
def test_tpu_vm_slices_map_to_machine_type_and_topology(accelerator, machine, topology, replicas):
    hardware = vertex.tpu_hardware(accelerator)
    assert hardware.machine_spec == {"machineType": machine, "tpuTopology": topology}
    assert hardware.replicas_per_machine == replicas


def test_tpu_v3_is_the_eight_core_cloud_tpu_machine():
    hardware = vertex.tpu_hardware("v3-8")
    assert hardware.machine_spec == {"machineType": "cloud-tpu", "acceleratorType": "TPU_V3",
                                     "acceleratorCount": 8}
    assert hardware.replicas_per_machine == 8  # 4 chips, 2 TensorCores each


@pytest.mark.parametrize("accelerator, fix", [
    ("v5litepod-3", "chips"), ("v3-32", "--tpu=v3-8"), ("tpu-v9", "v5litepod-N")])
def test_unknown_tpu_names_the_supported_ones(accelerator, fix):
    with pytest.raises(SpecError, match=fix):
        vertex.tpu_hardware(accelerator)


def test_several_gpu_machines_are_a_primary_and_a_worker_pool():
    hardware = vertex.gpu_hardware("a100", count=4)
    job = _job(hardware, replica_count=3)
    primary, workers = job["jobSpec"]["workerPoolSpecs"]
    assert primary["machineSpec"] == {"machineType": "a2-highgpu-4g",
                                      "acceleratorType": "NVIDIA_TESLA_A100",
                                      "acceleratorCount": 4}
    assert (primary["replicaCount"], workers["replicaCount"]) == (1, 2)
    assert workers["containerSpec"] == primary["containerSpec"]
    assert vertex.num_replicas(hardware, 3) == 12


def test_gpu_count_must_fit_the_machine():
    with pytest.raises(SpecError, match="comes 1 or 2 or 4 per machine"):
        vertex.gpu_hardware("t4", count=3)
    with pytest.raises(SpecError, match="not a known Vertex AI GPU"):
        vertex.gpu_hardware("rtx4090")
    assert vertex.gpu_hardware("NVIDIA_L4", 1).machine_spec["machineType"] == "g2-standard-8"


def test_spot_sets_the_scheduling_strategy():
    job = _job(vertex.tpu_hardware("v5litepod-4"), spot=True)
    assert job["jobSpec"]["scheduling"] == {"strategy": "SPOT"}


@pytest.mark.parametrize("field, value, message", [
    ("image", "", "--image is required"),
    ("image", "Not An Image!", "not a container image reference"),
    ("bucket", "/local/dir", "not a Cloud Storage path"),
    ("bucket", "gs://A", "not a Cloud Storage path"),
])
def test_image_and_bucket_are_checked(field, value, message):
    kwargs = dict(display_name="digits", image=IMAGE, bucket=BUCKET,
                  hardware=vertex.tpu_hardware("v5litepod-8"), args=[])
    kwargs[field] = value
    with pytest.raises(SpecError, match=message):
        vertex.build_job(**kwargs)


def test_tpu_jobs_have_one_replica():
    with pytest.raises(SpecError, match="pick a larger slice"):
        _job(vertex.tpu_hardware("v5litepod-8"), replica_count=2)


def test_config_is_parsed_and_the_batch_checked_against_the_replicas():
    warnings = vertex.validate_config(["digits.gin"], ["Trainer.global_batch_size=1024"], [], [],
                                      replicas=8, kind="tpu")
    assert warnings == []  # 128 per replica
    warnings = vertex.validate_config(["digits.gin"], [], [], [], replicas=8, kind="tpu")
    assert any("not a multiple of 128" in w for w in warnings)  # digits.gin: 64 / 8 = 8
    with pytest.raises(SpecError, match="not divisible by the 12 replicas.*multiple of 12"):
        vertex.validate_config(["digits.gin"], [], [], [], replicas=12, kind="gpu")
    with pytest.raises(SpecError, match="did you mean 'train_steps'"):
        vertex.validate_config(["digits.gin"], ["Trainer.train_step=5"], [], [],
                               replicas=1, kind="gpu")
    with pytest.raises(SpecError, match="Trainer.task is not bound"):
        vertex.validate_config([], ["Trainer.train_steps=5"], [], [], replicas=1, kind="gpu")
    with pytest.raises(SpecError, match="forces resolve_strategy.strategy='mirrored'"):
        vertex.validate_config(["digits.gin"], ["resolve_strategy.strategy='mirrored'"], [], [],
                               replicas=8, kind="tpu")


def test_submit_without_aiplatform_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud.aiplatform_v1", None)  # import fails
    cloud = sys.modules.get("google.cloud")  # imported by an earlier test on this worker:
    if cloud is not None:  # `from google.cloud import aiplatform_v1` reads the attribute
        monkeypatch.delattr(cloud, "aiplatform_v1", raising=False)
    with pytest.raises(SpecError, match="pip install google-cloud-aiplatform"):
        vertex.submit({}, project="p", region="us-central1")


@pytest.mark.start_early(6)
def test_spec_parses_as_the_vertex_ai_api_message():
    """Where google-cloud-aiplatform is installed: the JSON is a valid v1 CustomJob."""
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    for hardware, replicas in ((vertex.tpu_hardware("v5litepod-16"), 1),
                               (vertex.tpu_hardware("v3-8"), 1),
                               (vertex.gpu_hardware("l4", 2), 3)):
        job = _job(hardware, replica_count=replicas, spot=True)
        parsed = aiplatform_v1.CustomJob.from_json(json.dumps(job))
        assert len(parsed.job_spec.worker_pool_specs) == len(job["jobSpec"]["workerPoolSpecs"])


@pytest.mark.slow
def test_cli_prints_the_job_as_json_on_stdout(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    base = [sys.executable, "-m", "tputrain.run", "vertex-spec", "--gin_file=digits.gin",
            f"--image={IMAGE}", f"--bucket={BUCKET}"]
    ok = subprocess.run(base + ["--tpu=v5litepod-8", "--gin_param=Trainer.global_batch_size=1024"],
                        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    job = json.loads(ok.stdout)
    (pool,) = job["jobSpec"]["workerPoolSpecs"]
    assert pool["machineSpec"]["machineType"] == "ct5lp-hightpu-8t"
    assert f"--model_dir={BUCKET}/tputrain-digits/model" in pool["containerSpec"]["args"]
