"""`tputrain vertex-spec`: the Vertex AI CustomJob that trains a gin config on a TPU or GPU.

Prints the CustomJob (the REST body: `displayName` and `jobSpec.workerPoolSpecs`)
whose container runs `python -m tputrain.run` with your gin files, writing to
`--bucket`. Everything is validated offline before anything is printed: the
accelerator and machine type, the image and bucket names, and the gin config
itself (parsed here, with `Trainer.task` bound and the global batch divisible by
the job's replica count). `--submit` sends it with google-cloud-aiplatform, which
is only needed (and only imported) then. With `--tune=SPEC` (a tuning spec, as
`tputrain tune` reads) it writes a HyperparameterTuningJob whose trials run that
job, each reporting the spec's metric at every evaluation (docs/tracking.md).

    tputrain vertex-spec --gin_file=digits.gin --tpu=v5litepod-8 \\
        --image=us-docker.pkg.dev/my-project/train/tputrain:latest --bucket=gs://my-bucket
"""

from __future__ import annotations

import json
import sys

from absl import flags

from tputrain.cli.common import define_gin_flags, list_in_help, reject_arguments, run_command
from tputrain.jobs.vertex import (Hardware, SpecError, build_job, check_bucket, container_args,
                             default_display_name, gpu_hardware, num_replicas, submit,
                             tpu_hardware, validate_config)
from tputrain.tuning.spec import SpecError as TuningSpecError
from tputrain.tuning.spec import TuningSpec, binding_lines, load_spec
from tputrain.tuning.vertex_job import build_tuning_job, submit_tuning_job

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    before = set(flag_values)
    define_gin_flags(flag_values)  # --gin_file, --gin_param, ..., --model_dir
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("tpu", None, "Cloud TPU slice, e.g. v5litepod-8, v5litepod-16, v3-8, "
                        "v6e-8.", **fv)
    flags.DEFINE_string("gpu", None, "GPU type, e.g. a100, l4, t4, v100 (or the Vertex enum, "
                        "NVIDIA_TESLA_A100).", **fv)
    flags.DEFINE_integer("gpu_count", 1, "GPUs per machine (with --gpu).", **fv)
    flags.DEFINE_integer("replica_count", 1, "Machines (GPU/CPU jobs); more than 1 trains with "
                         "MultiWorkerMirroredStrategy.", **fv)
    flags.DEFINE_string("machine_type", None, "Overrides the machine type (alone: a CPU job).",
                        **fv)
    flags.DEFINE_string("tpu_topology", None, "Overrides the TPU topology, e.g. 4x4.", **fv)
    flags.DEFINE_string("image", None, "Container image with tputrain and your code installed.",
                        **fv)
    flags.DEFINE_string("bucket", None, "gs:// location for the job's output; the model_dir "
                        "defaults to BUCKET/DISPLAY_NAME/model.", **fv)
    flags.DEFINE_string("display_name", None, "Job name; default tputrain-<first gin file>.",
                        **fv)
    flags.DEFINE_bool("spot", False, "Run on Spot VMs (preemptible; tputrain resumes from the "
                      "last checkpoint when Vertex AI restarts the job).", **fv)
    flags.DEFINE_bool("validate_config", True, "Parse the gin config here before printing "
                      "(needs your --gin_import modules importable locally).", **fv)
    flags.DEFINE_bool("submit", False, "Create the job with google-cloud-aiplatform.", **fv)
    flags.DEFINE_string("project", None, "GCP project (with --submit).", **fv)
    flags.DEFINE_string("region", "us-central1", "Vertex AI region (with --submit).", **fv)
    flags.DEFINE_string("tune", None, "A tuning spec (YAML, as `tputrain tune` reads): write a "
                        "HyperparameterTuningJob whose trials run this job instead.", **fv)
    list_in_help([name for name in flag_values if name not in before], flag_values)


def _hardware() -> Hardware:
    """The machine the flags ask for: a TPU slice, GPUs, or a CPU machine type."""
    if FLAGS.tpu and FLAGS.gpu:
        raise SpecError("pass --tpu or --gpu, not both")
    if FLAGS.tpu:
        return tpu_hardware(FLAGS.tpu, FLAGS.machine_type, FLAGS.tpu_topology)
    if FLAGS.gpu:
        return gpu_hardware(FLAGS.gpu, FLAGS.gpu_count, FLAGS.machine_type)
    if FLAGS.machine_type:
        return Hardware({"machineType": FLAGS.machine_type}, 1, "cpu")
    raise SpecError("pass --tpu=v5litepod-8 (or another slice), --gpu=TYPE, or "
                    "--machine_type=TYPE for a CPU-only job")


def _job(hardware: Hardware) -> dict:
    """The CustomJob the flags describe (validated, not yet against the gin config)."""
    check_bucket(FLAGS.bucket)
    display_name = FLAGS.display_name or default_display_name(FLAGS.gin_file)
    model_dir = FLAGS.model_dir or f"{FLAGS.bucket.rstrip('/')}/{display_name}/model"
    check_bucket(model_dir, flag="--model_dir")
    args = container_args(FLAGS.gin_file, FLAGS.gin_param, FLAGS.gin_search_path,
                          FLAGS.gin_import, model_dir)
    return build_job(display_name=display_name, image=FLAGS.image, bucket=FLAGS.bucket,
                     hardware=hardware, args=args, replica_count=FLAGS.replica_count,
                     spot=FLAGS.spot)


def _tuning_spec() -> TuningSpec | None:
    """--tune's spec, read and checked (its errors are the CLI's SpecErrors)."""
    if not FLAGS.tune:
        return None
    if FLAGS.model_dir:
        raise SpecError("--tune: each trial trains in its own folder under --bucket: "
                        "leave out --model_dir")
    try:
        return load_spec(FLAGS.tune)
    except TuningSpecError as error:
        raise SpecError(f"--tune={FLAGS.tune}: {error}") from None


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    try:
        if not FLAGS.gin_file:
            raise SpecError("pass --gin_file=CONFIG (e.g. --gin_file=digits.gin)")
        hardware, tuning = _hardware(), _tuning_spec()
        job = _job(hardware)
        if FLAGS.validate_config:
            # A trial's bindings must parse too: checked with each parameter's first value.
            trial = binding_lines({p.binding: p.values[0] if p.values else p.low
                                   for p in (tuning.params if tuning else ())})
            for warning in validate_config(FLAGS.gin_file, [*FLAGS.gin_param, *trial],
                                           FLAGS.gin_search_path, FLAGS.gin_import,
                                           num_replicas(hardware, FLAGS.replica_count),
                                           hardware.kind):
                print(f"tputrain vertex-spec: warning: {warning}", file=sys.stderr)
        job = build_tuning_job(tuning, job) if tuning else job
        print(json.dumps(job, indent=2))
        if FLAGS.submit:
            name = (submit_tuning_job(job, FLAGS.project, FLAGS.region) if tuning
                    else submit(job, FLAGS.project, FLAGS.region))
            print(f"tputrain vertex-spec: submitted {name}", file=sys.stderr)
    except SpecError as error:
        print(f"tputrain vertex-spec: error: {error}", file=sys.stderr)
        sys.exit(2)


def console_main() -> None:
    """`tputrain vertex-spec`."""
    define_flags()
    run_command(main)
