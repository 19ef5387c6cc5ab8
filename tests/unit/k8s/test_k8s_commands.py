"""``flexrun k8s render|validate`` wiring: add_parser, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from k8s_paths import EXAMPLE, GOLDEN

from flexrun.errors import SpecError
from flexrun.k8s.commands import add_parser, main

pytestmark = pytest.mark.timeout(60)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexrun")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_add_parser_registers_render_and_validate_with_funcs() -> None:
    args = _parse(["k8s", "render", "job.yaml", "-o", "out.yaml"])
    assert (args.job, args.output) == ("job.yaml", "out.yaml") and callable(args.func)
    args = _parse(["k8s", "validate", "m.yaml", "--kubernetes-version", "1.30"])
    assert (args.file, args.kubernetes_version) == ("m.yaml", "1.30") and callable(args.func)


def test_render_to_stdout_matches_golden(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["k8s", "render", str(GOLDEN / "tcp.job.yaml")])
    assert args.func(args) == 0
    assert capsys.readouterr().out == (GOLDEN / "tcp.yaml").read_text(encoding="utf-8")


def test_render_to_file_then_validate_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "manifests.yaml"
    args = _parse(["k8s", "render", str(EXAMPLE), "-o", str(out)])
    assert args.func(args) == 0
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text())] == [
        "PersistentVolumeClaim",
        "Secret",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "PyTorchJob",
    ]
    args = _parse(["k8s", "validate", str(out)])
    assert args.func(args) == 0
    assert "6 object(s) valid" in capsys.readouterr().out


def test_render_bad_spec_raises_spec_error_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text('metadata: {name: j}\nspec: {image: i, script: t.py, nnodes: "4:2"}\n')
    args = _parse(["k8s", "render", str(bad)])
    with pytest.raises(SpecError, match=r"spec\.nnodes: min 4 > max 2"):
        args.func(args)


def test_validate_broken_manifest_prints_all_and_raises_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = list(yaml.safe_load_all((GOLDEN / "tcp.yaml").read_text()))
    job = docs[-1]
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    job["spec"]["pytorchReplicaSpecs"]["Master"] = dict(
        job["spec"]["pytorchReplicaSpecs"]["Worker"], replicas=2
    )
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    args = _parse(["k8s", "validate", str(f)])
    with pytest.raises(SpecError) as info:
        args.func(args)
    assert "\n" not in str(info.value) and "more error" in str(info.value)
    err = capsys.readouterr().err
    assert "spec.pytorchReplicaSpecs.Master.replicas" in err
    assert "spec.pytorchReplicaSpecs.Worker.restartPolicy" in err


def test_main_turns_errors_into_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexrun: error:") and "cannot read" in err and "\n" not in err


def test_module_entry_point_runs(tmp_path: Path) -> None:
    out = tmp_path / "m.yaml"
    render = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexrun.k8s.commands",
            "k8s",
            "render",
            str(EXAMPLE),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert render.returncode == 0, render.stderr
    check = subprocess.run(
        [sys.executable, "-m", "flexrun.k8s.commands", "k8s", "validate", "-q", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (check.returncode, check.stdout, check.stderr) == (0, "", "")
