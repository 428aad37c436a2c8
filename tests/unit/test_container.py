"""launcher.container without a cluster: checks before submission, the rendered step, the image's identity as the
batch script computes it (real bash), and what a start records. The runs on the local cluster are in
tests/cluster/test_container_slurm.py."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.launch import container as ctr
from gwenlake_hpc.job.run_environment import check_same_image, container_start
from helpers.oci_bundle import make_bundle


def lc(**container):
    return OmegaConf.create({"container": {"image": None, "runtime": None, "binds": [], "gpu": None, "env": {},
                                           "python": "python3", "pin": False, **container}})


def paths(tmp_path):
    for name in ("runs", "data", "models"):
        (tmp_path / name).mkdir(exist_ok=True)
    return {"runs_root": str(tmp_path / "runs"), "data_root": str(tmp_path / "data"),
            "model_repo": str(tmp_path / "models")}


def which_only(*names):
    return lambda name: f"/usr/bin/{name}" if name in names else None


def test_no_image_is_no_container(tmp_path):
    assert ctr.prepare(lc(), paths(tmp_path), tmp_path / "f", tmp_path) is None


def test_apptainer_step_binds_the_job_paths_and_passes_gpus(tmp_path):
    image = tmp_path / "train.sif"
    image.write_bytes(b"SIF" * 1000)
    folder = tmp_path / "runs" / "m" / "r" / "slurm"
    step = ctr.prepare(lc(image=str(image), binds=["/etc:/host-etc:ro"]), paths(tmp_path), folder, tmp_path,
                       gpus_requested=True, which=which_only("apptainer"))
    assert step.runtime == "apptainer" and step.image == str(image)
    words = step.command
    assert words[:5] == ["apptainer", "exec", "--pwd", str(tmp_path), "--nv"] and words[-2:] == [str(image), "python3"]
    binds = words[words.index("--bind") + 1].split(",")
    # runs_root covers the job folder inside it; the submitting directory covers the roots under it
    assert f"{tmp_path}:{tmp_path}:rw" in binds and "/etc:/host-etc:ro" in binds and len(binds) == 2
    assert step.python() == " ".join(words) + " -m gwenlake_hpc.launch.boot"
    assert step.srun_args == []
    # the teardown runs on the host from a standalone copy of the requeue module
    assert Path(step.teardown_script).read_text().startswith('"""The requeue decision')
    assert "python3 " + step.teardown_script in step.teardown(3, 60)[1]
    out = subprocess.run(["python3", step.teardown_script, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--max-retries" in out.stdout


def test_gpu_false_and_no_gpus_requested_have_no_nv(tmp_path):
    image = tmp_path / "train.sif"
    image.write_bytes(b"x")
    for kwargs, requested in (({"gpu": False}, True), ({}, False)):
        step = ctr.prepare(lc(image=str(image), **kwargs), paths(tmp_path), tmp_path / "f", tmp_path,
                           gpus_requested=requested, which=which_only("apptainer"), write=False)
        assert "--nv" not in step.command


def test_docker_reference_is_pulled_by_the_runtime(tmp_path):
    step = ctr.prepare(lc(image="docker://ghcr.io/acme/train@sha256:" + "a" * 64, runtime="singularity"),
                       paths(tmp_path), tmp_path / "f", tmp_path, which=which_only("singularity"), write=False)
    assert step.command[:2] == ["singularity", "exec"] and step.image.startswith("docker://")


@pytest.mark.parametrize("settings, which, needle", [
    ({"image": "missing.sif"}, ("apptainer",), "does not exist"),
    ({"image": "IMG", "runtime": "docker"}, ("apptainer",), "launcher.container.runtime='docker'"),
    ({"image": "IMG"}, (), "`apptainer` is not installed"),
    ({"image": "IMG", "runtime": "oci"}, ("apptainer",), "runtime=oci needs an OCI bundle"),
    ({"image": "IMG", "binds": ["/nope/nothing"]}, ("apptainer",), "/nope/nothing does not exist"),
    ({"image": "IMG", "binds": ["/etc:rel"]}, ("apptainer",), "absolute path"),
    ({"image": "IMG", "binds": ["/etc:/e:rx"]}, ("apptainer",), "ro or rw"),
    ({"image": "IMG", "python": "python3 -u"}, ("apptainer",), "launcher.container.python"),
    ({"image": "IMG", "env": {"1BAD": "x"}}, ("apptainer",), "launcher.container.env.1BAD"),
    ({"image": "IMG", "env": {"é": "x"}}, ("apptainer",), "launcher.container.env.é"),
    ({"image": "IMG", "binds": ["/etc:/a\nb"]}, ("apptainer",), "control characters"),
])
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, settings, which, needle):
    image = tmp_path / "IMG"
    image.write_bytes(b"x")
    folder = tmp_path / "f"
    with pytest.raises(ConfigError, match=None) as err:
        ctr.prepare(lc(**settings), paths(tmp_path), folder, tmp_path, which=which_only(*which))
    assert needle in str(err.value)
    assert not folder.exists()


def test_oci_without_oci_conf_is_refused(tmp_path, monkeypatch):
    bundle = make_bundle(tmp_path / "bundle")
    monkeypatch.setattr(ctr, "OCI_CONF_DIRS", (str(tmp_path / "no-slurm"),))
    with pytest.raises(ConfigError, match="SLURM has no oci.conf"):
        ctr.prepare(lc(image=str(bundle)), paths(tmp_path), tmp_path / "f", tmp_path,
                    environ={"SLURM_CONF": str(tmp_path / "etc" / "slurm.conf")})


def test_oci_conf_without_run_is_refused_and_without_exec_warned(caplog):
    with pytest.raises(ConfigError, match="neither RunTimeRun nor RunTimeCreate"):
        ctr.check_oci_conf('RunTimeQuery="runc state %n"\n', "/etc/slurm/oci.conf")
    with caplog.at_level(logging.WARNING):
        ctr.check_oci_conf('RunTimeRun="runc run %n -b %b"  # no exec\n', "x/oci.conf")
    assert "does not start with `exec`" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ctr.check_oci_conf('RunTimeRun="exec runc run %n -b %b"\n', "x/oci.conf")
    assert caplog.text == ""


def test_oci_derived_bundle_mirrors_the_root_and_adds_the_binds(tmp_path, monkeypatch):
    bundle = make_bundle(tmp_path / "bundle")
    spec = json.loads((bundle / "config.json").read_text())  # as `runc spec` writes it: its own pid and network
    spec["linux"]["namespaces"] += [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}]
    (bundle / "config.json").write_text(json.dumps(spec))
    original = (bundle / "config.json").read_text()
    conf = tmp_path / "etc" / "oci.conf"
    conf.parent.mkdir()
    conf.write_text('RunTimeQuery="runc state"\nRunTimeRun="exec runc run %n -b %b"\n')
    folder = tmp_path / "runs" / "slurm"
    step = ctr.prepare(lc(image=str(bundle), python="/venv/bin/python"), paths(tmp_path), folder, tmp_path,
                       environ={"SLURM_CONF": str(conf.parent / "slurm.conf")}, which=which_only())
    (derived,) = folder.glob("oci-bundle-*")  # one per submission: a later one never changes what this one runs
    assert step.runtime == "oci" and step.srun_args == [f"--container={derived}"]
    assert step.command == ["/venv/bin/python"]
    assert (bundle / "config.json").read_text() == original  # the user's bundle is untouched
    spec = json.loads((derived / "config.json").read_text())
    assert spec["root"]["path"] == str((derived / "rootfs").resolve()) and spec["root"]["readonly"] is True
    assert spec["process"]["cwd"] == str(tmp_path)  # SLURM leaves the spec's (/): the job starts where submitted
    assert [n["type"] for n in spec["linux"]["namespaces"]] == ["mount", "ipc"]  # the node's network and processes
    mounts = {m["destination"]: m for m in spec["mounts"]}
    # the top level of the user's root: directories bound, links copied, covered paths only as mount points
    assert mounts["/gwenlake-test-image"]["source"] == str(bundle / "rootfs" / "gwenlake-test-image")
    assert (derived / "rootfs" / "bin").readlink() == Path("usr/bin")
    assert mounts["/usr"]["source"] == "/usr"  # the spec's own bind of /usr wins over the mirror of rootfs/usr
    assert mounts[str(tmp_path)]["options"] == ["rbind", "rw"]
    destinations = [m["destination"] for m in spec["mounts"]]
    assert destinations.index(str(tmp_path)) > destinations.index("/tmp")  # ours after the spec's own
    # the digest covers the spec that runs and the image's entries the container sees
    assert any(f"cat {derived}/config.json" in line and "./gwenlake-test-image" in line for line in step.setup)
    again = ctr.prepare(lc(image=str(bundle), python="/venv/bin/python"), paths(tmp_path), folder, tmp_path,
                        environ={"SLURM_CONF": str(conf.parent / "slurm.conf")}, which=which_only())
    assert again.srun_args != step.srun_args and (derived / "config.json").is_file()


@pytest.mark.parametrize("spec, needle", [
    ({"root": {"path": 5}}, "no root.path"),
    ({"root": {"path": None}}, "no root.path"),
    ([1, 2], "no root.path"),
    ({"root": {"path": "rootfs"}, "mounts": {"a": 1}}, "mounts must be a JSON array"),
    ({"root": {"path": "rootfs"}, "mounts": [1]}, "arrays of objects"),
    ({"root": {"path": "rootfs"}, "linux": "x"}, "linux must be a JSON object"),
    ({"root": {"path": "rootfs"}, "process": []}, "process must be a JSON object"),
])
def test_a_malformed_bundle_spec_is_exit_2_before_anything_is_written(tmp_path, spec, needle):
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps(spec))
    conf = tmp_path / "etc" / "oci.conf"  # the node's oci.conf is fine: only the spec is wrong
    conf.parent.mkdir()
    conf.write_text('RunTimeQuery="runc state"\nRunTimeRun="exec runc run %n -b %b"\n')
    folder = tmp_path / "f"
    with pytest.raises(ConfigError, match=needle):
        ctr.prepare(lc(image=str(bundle)), paths(tmp_path), folder, tmp_path,
                    environ={"SLURM_CONF": str(conf.parent / "slurm.conf")}, which=which_only())
    assert not folder.exists()


def test_a_sweep_binds_every_tasks_roots(tmp_path):
    image = tmp_path / "train.sif"
    image.write_bytes(b"x")
    other = tmp_path.parent / (tmp_path.name + "-other-data")
    other.mkdir()
    step = ctr.prepare(lc(image=str(image)), paths(tmp_path), tmp_path / "f", tmp_path, which=which_only("apptainer"),
                       write=False, more_paths=[str(other)])
    assert f"{other}:{other}:rw" in step.command[step.command.index("--bind") + 1].split(",")


def run_identity(lines, env=None):
    script = "\n".join([*lines, 'printf "%s|%s|%s\\n" "$GWENLAKE_CONTAINER_DIGEST" "$GWENLAKE_CONTAINER_RUNTIME" '
                                '"$GWENLAKE_CONTAINER_PIN"'])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip().split("|")


def test_file_digest_is_sha256_and_cached_by_stat(tmp_path):
    import hashlib

    image = tmp_path / "train.sif"
    image.write_bytes(b"image one")
    folder = tmp_path / "f"
    folder.mkdir()
    lines = ctr.identity_lines("apptainer", str(image), folder, pin=True)
    digest, runtime, pin = run_identity(lines)
    assert digest == "sha256:" + hashlib.sha256(b"image one").hexdigest() and runtime == "apptainer" and pin == "1"
    # a cached digest is used while size, time and inode are the same ...
    cache = (folder / "image-digest").read_text().splitlines()
    (folder / "image-digest").write_text(f"{cache[0]}\nsha256:cached\n")
    assert run_identity(lines)[0] == "sha256:cached"
    # ... and a rebuilt image (a new file) is hashed again
    (tmp_path / "new.sif").write_bytes(b"image two")
    (tmp_path / "new.sif").replace(image)
    assert run_identity(lines)[0] == "sha256:" + hashlib.sha256(b"image two").hexdigest()


def test_bundle_digest_follows_the_root_files_not_runtime_mount_points(tmp_path):
    bundle = make_bundle(tmp_path / "bundle", marker="one")
    (bundle / "rootfs" / "opt").mkdir()
    (bundle / "rootfs" / "opt" / "tool").write_text("v1\n")
    entries = ["bin", "gwenlake-test-image", "opt"]
    lines = ctr.identity_lines("oci", str(bundle), tmp_path, pin=False, rootfs=bundle / "rootfs",
                               spec_file=bundle / "config.json", entries=entries)
    first = run_identity(lines)[0]
    assert first.startswith("sha256:") and len(first) == 71
    (bundle / "rootfs" / "opt" / "mnt").mkdir()  # mount points a runtime makes: a directory, an empty file
    (bundle / "rootfs" / "opt" / "lic.txt").touch()
    (bundle / "rootfs" / "newtop").write_text("not seen by the container: its entries are fixed at submission\n")
    assert run_identity(lines)[0] == first
    (bundle / "rootfs" / "opt" / "tool").write_text("v2, longer\n")
    second = run_identity(lines)[0]
    assert second != first
    (bundle / "rootfs" / "gwenlake-test-image").write_text("two, longer\n")
    assert run_identity(lines)[0] not in (first, second)


def test_unpinned_reference_has_no_digest_and_pinned_its_own(tmp_path):
    assert run_identity(ctr.identity_lines("apptainer", "docker://python:3.11", tmp_path, False))[0] == ""
    ref = "docker://python@sha256:" + "b" * 64
    assert run_identity(ctr.identity_lines("apptainer", ref, tmp_path, False))[0] == "sha256:" + "b" * 64


def test_a_start_reads_its_container_and_refuses_to_run_outside_it():
    env = {"GWENLAKE_CONTAINER_RUNTIME": "oci", "GWENLAKE_CONTAINER_IMAGE": "/b", "GWENLAKE_CONTAINER_DIGEST":
           "sha256:1", "GWENLAKE_CONTAINER_RUNTIME_VERSION": "runc 1", "GWENLAKE_CONTAINER_HOST_MNT_NS": "mnt:[1]"}
    assert container_start({}) is None
    assert container_start(env, own_mnt_ns="mnt:[2]") == {"runtime": "oci", "image": "/b", "digest": "sha256:1",
                                                          "runtime_version": "runc 1"}
    with pytest.raises(ConfigError, match="not running inside the container"):
        container_start(env, own_mnt_ns="mnt:[1]")


def test_a_changed_image_warns_or_is_refused_when_pinned(caplog):
    starts = [{"container": {"image": "/a.sif", "digest": "sha256:1"}}, {"host": "n1"}]
    same, changed = {"image": "/a.sif", "digest": "sha256:1"}, {"image": "/a.sif", "digest": "sha256:2"}
    with caplog.at_level(logging.WARNING):
        check_same_image(starts, same, environ={})
        assert caplog.text == ""
        check_same_image(starts, changed, environ={})
    assert "changed since the previous start" in caplog.text and "sha256:2" in caplog.text
    with pytest.raises(ConfigError, match="launcher.container.pin=true"):
        check_same_image(starts, changed, environ={"GWENLAKE_CONTAINER_PIN": "1"})
    check_same_image([], changed, environ={"GWENLAKE_CONTAINER_PIN": "1"})  # a first start has nothing to differ


def test_requeue_module_runs_standalone_with_the_same_exit_status():
    from gwenlake_hpc.base.errors import EXIT_EVICTED, EXIT_USAGE
    from gwenlake_hpc.launch import requeue

    assert requeue.EXIT_EVICTED == EXIT_EVICTED and requeue.EXIT_USAGE == EXIT_USAGE


def test_decorator_image_is_the_default_the_config_overrides():
    from gwenlake_hpc.launch.slurm import with_declared
    from gwenlake_hpc.authoring.resources import Resources, parse_resources
    from gwenlake_hpc.base.errors import TrainDefinitionError

    res = parse_resources({"image": "/img/train.sif"})
    assert Resources.from_dict(res.to_dict()) == res
    assert with_declared(lc(), res).container.image == "/img/train.sif"
    assert with_declared(lc(image="/other.sif"), res).container.image == "/other.sif"
    with pytest.raises(TrainDefinitionError, match="image"):
        parse_resources({"image": "a\nb"})


