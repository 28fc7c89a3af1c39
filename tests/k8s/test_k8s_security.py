"""Security properties of every manifest: non-root pods, no privilege escalation, secrets only by reference,
least-privilege namespaced RBAC without wildcards."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from k8s_objects import K8S, REPO, all_pod_templates

from images.deploy import SERVICE_ACCOUNT

CREDENTIAL_NAME = re.compile(r"(^|_)(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS?|AUTH|APIKEY)(_|$)", re.I)
CREDENTIAL_VALUE = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"(ghp|gho|github_pat|hf|sk|xox[bp])[-_][A-Za-z0-9_]{16,}"),  # GitHub / HF / OpenAI / Slack tokens
    re.compile(r"[A-Za-z0-9+/]{32,}={0,2}"),  # long base64 blobs
    re.compile(r"[0-9a-f]{32,}"),  # long hex keys
]


def _pods(rendered):
    for where, objects in rendered.items():
        for role, template, _ in all_pod_templates(objects):
            yield f"{where}:{role}", template["spec"]


def _containers(spec):
    return spec.get("initContainers", []) + spec["containers"]


def test_pods_run_as_non_root_with_runtime_default_seccomp(rendered):
    pods = list(_pods(rendered))
    assert len(pods) >= 15
    for where, spec in pods:
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 1000 and ctx["runAsGroup"] == 1000, where
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), (where, key)
        assert spec["serviceAccountName"] == SERVICE_ACCOUNT, where
        assert spec["automountServiceAccountToken"] is False, where
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], where


def test_containers_cannot_escalate_and_have_read_only_roots(rendered):
    for where, spec in _pods(rendered):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in _containers(spec):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
            assert not ctx.get("privileged"), where
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx.get("runAsUser", 1000) != 0, where
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{where}: /tmp must be a writable emptyDir"


def test_shared_memory_is_a_memory_backed_emptydir(rendered):
    for where, spec in _pods(rendered):
        if where.endswith("submitter"):
            continue
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"], where


def test_credential_name_pattern():
    assert all(CREDENTIAL_NAME.search(n) for n in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "DB_PASSWORD", "API_KEY"))
    assert not any(CREDENTIAL_NAME.search(n) for n in ("TOKENIZERS_PARALLELISM", "HOME", "KEYBOARD", "MONKEY"))


def test_credentials_only_by_reference(rendered):
    checked = 0
    for where, spec in _pods(rendered):
        for container in _containers(spec):
            for env in container.get("env", []):
                if "value" in env:
                    assert not CREDENTIAL_NAME.search(env["name"]), f"{where}: {env['name']} has a literal value"
                    assert not any(p.search(str(env["value"])) for p in CREDENTIAL_VALUE), (where, env)
                else:
                    ref = env["valueFrom"]
                    assert set(ref) <= {"secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef"}, where
                    checked += "secretKeyRef" in ref
            for source in container.get("envFrom", []):
                assert set(source) <= {"secretRef", "configMapRef", "prefix"}, where
    assert checked > 0  # the object-store credentials are wired, by reference


def _repo_yaml_documents():
    skip = {".venv", "venv", ".git", "node_modules", "runs", "__pycache__", ".ruff_cache", ".pytest_cache"}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith((".yaml", ".yml")):
                path = Path(root) / name
                try:
                    docs = list(yaml.safe_load_all(path.read_text()))
                except (yaml.YAMLError, UnicodeDecodeError):
                    continue
                for doc in docs:
                    yield path, doc


def test_no_secret_with_data_anywhere_in_the_repo():
    for path, doc in _repo_yaml_documents():
        if isinstance(doc, dict) and doc.get("kind") == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), f"{path} commits a Secret with data"


def test_readme_creates_secrets_from_the_environment_only():
    readme = (K8S / "README.md").read_text()
    literals = re.findall(r"--from-literal=([A-Z_]+)=(\S+)", readme)
    assert literals, "the README shows how to create the secrets"
    for key, value in literals:
        assert value.strip("\"'").startswith("$"), f"README puts a literal value in secret key {key}"


# --- RBAC ---------------------------------------------------------------------------------------------------------

ALLOWED = {
    "flyte-ray-plugin": {("ray.io", "rayjobs"): {"create", "get", "list", "watch", "update", "delete"}},
    "rlpipe-developer": {
        ("ray.io", "rayjobs"): {"create", "get", "list", "watch", "delete", "patch"},
        ("ray.io", "rayclusters"): {"create", "get", "list", "watch", "delete", "patch"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/log"): {"get", "list", "watch"},
        ("", "services"): {"get", "list", "watch"},
        ("", "pods/portforward"): {"create"},
        ("", "secrets"): {"get"},
    },
}


def _rbac(rendered, kinds):
    return [(w, o) for w, objs in rendered.items() for o in objs if o["kind"] in kinds]


def test_rbac_is_namespaced_only(rendered):
    assert _rbac(rendered, {"ClusterRole", "ClusterRoleBinding"}) == []
    bindings = _rbac(rendered, {"RoleBinding"})
    assert bindings
    for where, binding in bindings:
        assert binding["roleRef"]["kind"] == "Role", where


@pytest.mark.parametrize("field", ["apiGroups", "resources", "verbs", "resourceNames"])
def test_no_wildcards(rendered, field):
    for where, role in _rbac(rendered, {"Role"}):
        for rule in role["rules"]:
            assert not [v for v in rule.get(field, []) if "*" in v], f"{where} {role['metadata']['name']}: {rule}"


def test_roles_grant_exactly_the_documented_verbs(rendered):
    roles = _rbac(rendered, {"Role"})
    assert {r["metadata"]["name"] for _, r in roles} == set(ALLOWED)
    for where, role in roles:
        granted: dict[tuple[str, str], set[str]] = {}
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
        assert granted == ALLOWED[role["metadata"]["name"]], where
        secrets = [r for r in role["rules"] if "secrets" in r["resources"]]
        assert all(r.get("resourceNames") for r in secrets), f"{where}: secrets access must name the secret"


def test_ray_service_account_has_no_role_and_no_token(rendered):
    for where, objects in rendered.items():
        for obj in objects:
            if obj["kind"] == "ServiceAccount":
                assert obj["automountServiceAccountToken"] is False, where
            if obj["kind"] == "RoleBinding":
                assert SERVICE_ACCOUNT not in {s["name"] for s in obj["subjects"]}, where


def test_namespaces_enforce_pod_security(rendered):
    for where, objects in rendered.items():
        for ns in (o for o in objects if o["kind"] == "Namespace"):
            labels = ns["metadata"]["labels"]
            assert labels["pod-security.kubernetes.io/enforce"] in ("baseline", "restricted"), where
            assert labels["pod-security.kubernetes.io/warn"] == "restricted", where


def test_kuberay_operator_values_are_least_privilege():
    values = yaml.safe_load((K8S / "kuberay-operator" / "values.yaml").read_text())
    assert values["singleNamespaceInstall"] is True and values["crNamespacedRbacEnable"] is True
    ctx = values["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["runAsNonRoot"] is True
    assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"] == {"drop": ["ALL"]}
