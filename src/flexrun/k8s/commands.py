"""``flexrun k8s render|validate``: argparse wiring for the Kubernetes commands.

Owns the two subcommands' flags and their one call each into ``spec``/``render``/
``validate``; no logic beyond printing. ``flexrun.cli`` registers them with
``add_parser(subparsers)``; each sets ``func(args) -> int``. Bad input raises
:class:`~flexrun.errors.SpecError` (the CLI prints one line and exits 2). Also runnable as
``python -m flexrun.k8s.commands render|validate ...`` (same exit codes).
"""

from __future__ import annotations

import argparse
import sys

from flexrun._cmdutil import standalone_main, write_output
from flexrun.errors import SpecError
from flexrun.k8s.spec_types import RUNTIME_KINDS, TARGETS


def render_command(args: argparse.Namespace) -> int:
    """Render a job spec to YAML on stdout or ``-o FILE``; 0 on success.

    Raises:
        SpecError: the spec is invalid (the message names the field).
        ConfigError: the output file cannot be written.
    """
    from flexrun.k8s.render import render, to_yaml
    from flexrun.k8s.spec import load_job_spec

    spec = load_job_spec(
        args.job,
        target=getattr(args, "target", None),
        runtime_kind=getattr(args, "runtime_kind", None),
    )
    text = to_yaml(render(spec))
    write_output(text, args.output)
    return 0


def validate_command(args: argparse.Namespace) -> int:
    """Validate manifests; print every problem to stderr; 0 when there is no error.

    Raises:
        SpecError: the file is unreadable or holds an invalid manifest (the first error,
            with the field named; all of them were printed before).
    """
    from flexrun.k8s.validate import validate_file

    report = validate_file(
        args.file,
        kubernetes_version=args.kubernetes_version,
        use_core_schemas=not args.structural_only,
        installed_runtimes=tuple(getattr(args, "installed_runtime", None) or ()),
    )
    for problem in report.problems:
        print(f"{args.file}: {problem}", file=sys.stderr)
    if not args.quiet:
        for note in report.notes:
            print(f"{args.file}: note: {note}", file=sys.stderr)
    if report.errors:
        first = report.errors[0]
        more = len(report.errors) - 1
        suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
        raise SpecError(f"{args.file}: {first}{suffix}")
    if not args.quiet:
        print(f"{args.file}: {len(report.checked)} object(s) valid")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``k8s`` with its ``render`` and ``validate`` subcommands."""
    k8s = subparsers.add_parser(
        "k8s",
        help="Kubernetes: render PyTorchJob or TrainJob manifests, validate manifests",
        description="Render a flexrun job spec into Kubernetes manifests, or validate manifests.",
    )
    sub = k8s.add_subparsers(dest="k8s_command", metavar="{render,validate}", required=True)

    render = sub.add_parser(
        "render",
        help="job spec -> PyTorchJob or TrainJob + runtime, store, Secrets, policies, PVC",
        description="Render a flexrun job spec (see examples/k8s/) into the workers (a "
        "Kubeflow PyTorchJob, or a Trainer v2 TrainJob and its runtime), the rendezvous "
        "store, its NetworkPolicy, the (empty) Secrets and the checkpoint PVC.",
    )
    render.add_argument("job", metavar="JOB.yaml", help="flexrun job spec")
    render.add_argument(
        "--target",
        choices=TARGETS,
        default=None,
        help="what runs the workers: pytorchjob (Kubeflow v1, elastic; the default) or "
        "trainjob (Kubeflow Trainer v2); overrides spec.target",
    )
    render.add_argument(
        "--runtime-kind",
        choices=RUNTIME_KINDS,
        default=None,
        help="trainjob: the kind of runtime rendered beside the TrainJob (default "
        "TrainingRuntime); overrides spec.trainJob.runtimeKind",
    )
    render.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    render.set_defaults(func=render_command)

    validate = sub.add_parser(
        "validate",
        help="check manifests (PyTorchJob, TrainJob and runtimes, core objects)",
        description="Check manifests: PyTorchJobs against the v1 schema and the operator's "
        "admission rules; TrainJobs, TrainingRuntimes and ClusterTrainingRuntimes against "
        "Trainer v2.3.0's CRD schemas and the controller's rules; core objects against "
        "Kubernetes' schemas (with kubernetes-validate installed; structural checks "
        "otherwise). Exit 2 on any error, each printed with the field's path.",
    )
    validate.add_argument("file", metavar="FILE", help="YAML manifests (multi-document)")
    validate.add_argument(
        "--kubernetes-version",
        metavar="X.Y",
        help="Kubernetes schemas to check core objects against (default: newest bundled)",
    )
    validate.add_argument(
        "--structural-only",
        action="store_true",
        help="skip Kubernetes' schemas even if kubernetes-validate is installed",
    )
    validate.add_argument(
        "--installed-runtime",
        action="append",
        metavar="KIND/NAME",
        help="a Trainer runtime the cluster already has (e.g. "
        "ClusterTrainingRuntime/torch-distributed): TrainJobs may reference it (repeatable)",
    )
    validate.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    validate.set_defaults(func=validate_command)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m flexrun.k8s.commands``)."""
    return standalone_main(add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
