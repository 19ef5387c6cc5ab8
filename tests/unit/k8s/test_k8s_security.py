"""Issue 18 on the Kubernetes side: no secret value in any manifest, Secrets referenced and
mounted, etcd with TLS and client certificates, NetworkPolicies that admit only the job's
pods, metrics on all interfaces only where a port is rendered; all of it passes validate."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_paths import EXAMPLE, GOLDEN, TRAINJOB_EXAMPLE

from flexrun.k8s.render import render, to_yaml
from flexrun.k8s.spec import load_job_spec, parse_job_spec
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(60)

Doc = dict[str, Any]
SOURCES = {
    "example": EXAMPLE,
    "trainjob-example": TRAINJOB_EXAMPLE,
    **{n: GOLDEN / f"{n}.job.yaml" for n in ("tcp", "etcd", "trainjob", "trainjob-etcd")},
}
SENTINEL = "s3cret-sentinel-5f2a"


def _all(source: str, **kw: Any) -> list[Doc]:
    return render(load_job_spec(SOURCES[source], **kw))


def _variants() -> Iterator[tuple[str, list[Doc]]]:
    """Each spec as written, and (unless it uses PyTorchJob-only fields) as a TrainJob."""
    for source in sorted(SOURCES):
        yield source, _all(source)
        if source != "etcd":  # it sets hpa: pytorchjob only
            yield f"{source}/trainjob", _all(source, target="trainjob")
            yield (
                f"{source}/cluster",
                _all(source, target="trainjob", runtime_kind="ClusterTrainingRuntime"),
            )


VARIANTS = dict(_variants())


def _strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def _worker_pods(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    """(pod template metadata, pod spec) of every worker pod template in the set."""
    out = []
    for d in docs:
        if d["kind"] == "PyTorchJob":
            t = d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
            out.append((t["metadata"], t["spec"]))
        elif d["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
            for job in d["spec"]["template"]["spec"]["replicatedJobs"]:
                t = job["template"]["spec"]["template"]
                out.append((t["metadata"], t["spec"]))
    assert out
    return out


def _argv(container: Doc) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_rendered_object_carries_a_secret_value(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Secrets the renderer could have picked up from its environment: it must not.
    for name in ("FLEXRUN_JOB_SECRET", "FLEXRUN_ETCD_PASSWORD", "PET_RDZV_CONF"):
        monkeypatch.setenv(name, f"password={SENTINEL}")
    source = variant.split("/")[0]
    kw = {}
    if "/" in variant:
        kw = {"target": "trainjob"}
        if variant.endswith("cluster"):
            kw["runtime_kind"] = "ClusterTrainingRuntime"
    docs = _all(source, **kw)
    assert SENTINEL not in to_yaml(docs)
    for d in docs:
        if d["kind"] == "Secret":
            assert set(d) == {"apiVersion", "kind", "metadata"}, "a Secret with values"
        for path, text in _strings(d):
            # The one `secret=` allowed: the command that generates a value, in the
            # placeholder's annotation (a shell substitution, not a value).
            low = text.lower().replace("--from-literal=secret=$(openssl rand -hex 32)", "")
            low = low.replace("--initial-cluster-token=", "")  # etcd's cluster id: the job name
            for word in ("password=", "secret=", "token="):
                assert word not in low, f"{d['kind']}{path}: {text}"
    for _, pod in _worker_pods(docs):
        for c in pod["containers"]:
            for env in c.get("env", []):
                name = env["name"].upper()
                if any(w in name for w in ("SECRET", "PASSWORD", "TOKEN")):
                    assert name.endswith("_FILE") and env["value"].startswith("/var/run/flexrun/")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_job_secret_is_referenced_mounted_read_only_and_named_by_a_file_path(variant: str) -> None:
    docs = VARIANTS[variant]
    job_secret = next(
        (
            d["metadata"]["name"]
            for d in docs
            if d["kind"] == "Secret" and "-secret" in d["metadata"]["name"]
        ),
        None,
    )
    for _, pod in _worker_pods(docs):
        (vol,) = [v for v in pod["volumes"] if v["name"] == "job-secret"]
        assert vol["secret"]["items"] == [{"key": "secret", "path": "secret"}]
        assert vol["secret"]["defaultMode"] == 0o440
        assert pod["securityContext"]["fsGroup"] == 10001  # group-readable for the image user
        name = vol["secret"]["secretName"]
        assert name == (job_secret or "llm-job-secret")  # rendered, or the spec's existing one
        (c,) = pod["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "job-secret"]
        assert mount == {
            "name": "job-secret",
            "mountPath": "/var/run/flexrun/secret",
            "readOnly": True,
        }
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["FLEXRUN_JOB_SECRET_FILE"] == "/var/run/flexrun/secret/secret"


def test_an_existing_secret_is_referenced_and_not_rendered() -> None:
    docs = VARIANTS["trainjob-etcd"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    vols = {v["name"]: v for _, pod in _worker_pods(docs) for v in pod["volumes"]}
    assert vols["job-secret"]["secret"]["secretName"] == "llm-job-secret"
    assert vols["etcd-tls"]["secret"]["secretName"] == "llm-etcd-certs"


def test_placeholder_secrets_say_how_to_fill_them() -> None:
    secrets = {d["metadata"]["name"]: d for d in VARIANTS["etcd"] if d["kind"] == "Secret"}
    assert set(secrets) == {"llm-etcd-secret", "llm-etcd-etcd"}
    how = secrets["llm-etcd-secret"]["metadata"]["annotations"]["flexrun.dev/values"]
    assert "kubectl create secret generic llm-etcd-secret --from-literal=secret=$(openssl" in how
    how = secrets["llm-etcd-etcd"]["metadata"]["annotations"]["flexrun.dev/values"]
    assert "--from-file=ca.crt --from-file=tls.crt --from-file=tls.key" in how


@pytest.mark.parametrize("variant", ["etcd", "trainjob-etcd", "trainjob-etcd/cluster"])
def test_etcd_speaks_tls_with_client_certificates_only(variant: str) -> None:
    docs = VARIANTS[variant]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    for flag in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert flag in cmd
    for key in ("trusted-ca-file", "cert-file", "key-file"):
        for prefix in ("--", "--peer-"):
            assert any(a.startswith(f"{prefix}{key}=/var/run/flexrun/etcd/") for a in cmd), key
    urls = [a.split("=", 1)[1] for a in cmd if "-urls=" in a or a.startswith("--initial-cluster=")]
    assert urls and all("http://" not in u and "https://" in u for u in urls), urls
    assert any(a == "--listen-client-urls=https://$(POD_IP):2379" for a in cmd)
    assert {"name": "etcd-tls", "mountPath": "/var/run/flexrun/etcd", "readOnly": True} in c[
        "volumeMounts"
    ]
    for _, wpod in _worker_pods(docs):
        argv = _argv(wpod["containers"][0])
        text = " ".join(argv)
        if "--rdzv-conf" in argv:  # trainjob: on the command line
            assert "cacert=/var/run/flexrun/etcd/ca.crt" in text
    for d in docs:
        if d["kind"] == "PyTorchJob":
            conf = {c["key"]: c["value"] for c in d["spec"]["elasticPolicy"]["rdzvConf"]}
            assert conf["cert"] == "/var/run/flexrun/etcd/tls.crt"


def _matches(selector: Doc, labels: Doc) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_network_policy_admits_only_the_jobs_pods_to_the_store(variant: str) -> None:
    docs = VARIANTS[variant]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    stores = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    (store,) = stores
    store_labels = store["spec"]["template"]["metadata"]["labels"]
    assert _matches(policy["spec"]["podSelector"]["matchLabels"], store_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    workers = [meta["labels"] for meta, _ in _worker_pods(docs)]
    rules = policy["spec"]["ingress"]
    client_port = (
        2379
        if store["kind"] == "StatefulSet"
        else store["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    )
    worker_rule = rules[0]
    (peer,) = worker_rule["from"]
    assert all(_matches(peer["podSelector"]["matchLabels"], w) for w in workers)
    assert not _matches(peer["podSelector"]["matchLabels"], store_labels)
    assert worker_rule["ports"] == [{"protocol": "TCP", "port": client_port}]
    # No rule admits everyone: each names pods (no empty `from`, no namespace/IP blocks).
    for rule in rules:
        assert rule["from"] and all(set(p) == {"podSelector"} for p in rule["from"])
    if store["kind"] == "StatefulSet":
        assert rules[1]["ports"] == [
            {"protocol": "TCP", "port": 2379},
            {"protocol": "TCP", "port": 2380},
        ]
        assert _matches(rules[1]["from"][0]["podSelector"]["matchLabels"], store_labels)


def test_network_policy_can_be_turned_off() -> None:
    doc = {
        "metadata": {"name": "j"},
        "spec": {"image": "i", "script": "t.py", "nnodes": 2, "networkPolicy": False},
    }
    assert not [d for d in render(parse_job_spec(doc)) if d["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_metrics_listen_on_all_interfaces_only_where_a_port_is_rendered(variant: str) -> None:
    for meta, pod in _worker_pods(VARIANTS[variant]):
        (c,) = pod["containers"]
        argv = _argv(c)
        ports = [p for p in c.get("ports", []) if p["name"] == "metrics"]
        if "--metrics-host" in argv:
            assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0"
            port = argv[argv.index("--metrics-port") + 1]
            assert [str(p["containerPort"]) for p in ports] == [port]
            assert meta["annotations"]["prometheus.io/port"] == port
        else:
            assert "--metrics-port" not in argv and not ports and "annotations" not in meta


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_set_passes_validate_with_its_policy_and_secrets(variant: str) -> None:
    docs = VARIANTS[variant]
    assert "NetworkPolicy" in {d["kind"] for d in docs}
    for core in (False, True):
        report = validate_documents(copy.deepcopy(docs), use_core_schemas=core)
        assert report.problems == (), [str(p) for p in report.problems]


def test_validate_warns_about_a_secret_with_values_in_the_file() -> None:
    docs = copy.deepcopy(VARIANTS["tcp"])
    secret = next(d for d in docs if d["kind"] == "Secret")
    secret["data"] = {"secret": "c2VjcmV0"}
    report = validate_documents(docs, use_core_schemas=False)
    assert report.ok
    assert any(
        not p.error and p.path == "data" and "secret values" in p.message for p in report.problems
    )
    secret["data"] = {"secret": "not base64!"}
    assert [p.path for p in validate_documents(docs, use_core_schemas=False).errors] == [
        "data.secret"
    ]


def test_broken_network_policy_is_reported_with_the_path() -> None:
    docs = copy.deepcopy(VARIANTS["tcp"])
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    policy["spec"]["ingress"][0]["ports"][0]["port"] = 70000
    policy["spec"]["policyTypes"] = ["Sideways"]
    paths = {p.path for p in validate_documents(docs, use_core_schemas=False).errors}
    assert paths == {"spec.ingress[0].ports[0].port", "spec.policyTypes[0]"}
