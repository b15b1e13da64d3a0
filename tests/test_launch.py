"""The launch scripts: their --dry_run commands (exact, shell-quoted, one a line), the code
tarball they ship (git-tracked files only), and tpu_pod.sh end to end against a stand-in gcloud
that plays a 2-worker TPU VM on this machine. No network, no gcloud or xpk needed."""

import json
import os
import shlex
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
    "--config=configs/tiny.py",
    "--config.data.system_prompt=a b",
    "--config.x=it's",
    "--workdir=gs://bucket/run $HOME",
]


def _env(tmp_path, **extra):
  env = {
      k: v
      for k, v in os.environ.items()
      if k not in ("PYTHON", "LOCAL_DEVICES", "XLA_FLAGS", "SLURM_SUBMIT_DIR")
  }
  env.update(TMPDIR=str(tmp_path), **extra)
  return env


def _run(tmp_path, script, *argv, rc=0, cwd=None, **env):
  p = subprocess.run(
      ["bash", os.path.join(ROOT, "launch", script), *argv],
      cwd=cwd or tmp_path,
      env=_env(tmp_path, **env),
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert p.returncode == rc, p.stderr
  return p


def _lines(p):
  return [shlex.split(line) for line in p.stdout.splitlines()]


def _after(argv, flag):
  return argv[argv.index(flag) + 1]


def _main_args(remote: str, end=None):
  """The arguments grpo_jax.main gets from a remote shell command string."""
  words = shlex.split(remote)
  words = words[words.index("grpo_jax.main") + 1 :]
  return words[: words.index(end)] if end else words


def _tracked():
  out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True)
  return {f for f in out.stdout.decode().split("\0") if f}


def _assert_code_only(names):
  assert {
      "setup.py",
      "grpo_jax/main.py",
      "requirements/constraints.txt",
      "launch/tpu_pod.sh",
  } <= names
  assert names <= _tracked()
  assert not [n for n in names if n.split("/")[0] in (".venv", "runs", "logs", ".git")]


@pytest.mark.parametrize("project", [None, "my-proj"])
def test_tpu_pod_dry_run(tmp_path, project):
  p = _run(
      tmp_path,
      "tpu_pod.sh",
      "my-tpu",
      "us-central2-b",
      *([project] if project else []),
      "--dry_run",
      "--run_name",
      "r1",
      "--",
      *ARGS,
  )
  pack, sync, setup, run, mkdir, collect = p.stdout.splitlines()
  gc = ["--zone", "us-central2-b"] + (["--project", project] if project else [])

  # 1. A tarball of the git-tracked files, built (dry run too) under $TMPDIR.
  tgz = shlex.split(pack)[-1][:-1]  # "... -czf PATH)"
  assert tgz.startswith(str(tmp_path)) and "git ls-files -z" in pack
  with tarfile.open(tgz) as tar:
    _assert_code_only({os.path.normpath(n) for n in tar.getnames()} - {"."})
  # 2. That tarball, not the repo folder, to every worker.
  assert shlex.split(sync) == [
      "gcloud",
      "compute",
      "tpus",
      "tpu-vm",
      "scp",
      tgz,
      "my-tpu:grpo_jax.tgz",
      "--worker=all",
      *gc,
  ]
  # 3. Swap in a fresh code dir, venv outside it, install with the TPU extra, on every worker.
  setup = shlex.split(setup)
  assert setup[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--worker=all"]
  remote = _after(setup, "--command")
  assert (
      'tar -xzf "$HOME"/grpo_jax.tgz -C "$HOME"/grpo_jax.new && rm -rf "$HOME"/grpo_jax && '
      'mv "$HOME"/grpo_jax.new "$HOME"/grpo_jax'
  ) in remote
  assert 'python3.12 -m venv "$HOME"/grpo_jax_venv' in remote
  assert (
      '"$HOME"/grpo_jax_venv/bin/python -m pip install -q -e ".[tpu,gcs]" '
      "-c requirements/constraints.txt"
  ) in remote
  # 4. One command for all workers, args verbatim, a log per worker.
  run = shlex.split(run)
  assert run[:7] == setup[:7] and run[7:-2] == gc and run[-2] == "--command"
  assert "--worker=all" in run and "--project" not in run[:7]
  assert _main_args(run[-1], "2>&1") == ["--distributed", *ARGS]
  assert run[-1].endswith('| tee "$HOME"/grpo_jax_logs/r1/worker-$(hostname).log')
  # 5. Logs back, one worker at a time, into ./logs/TPU/.
  assert shlex.split(mkdir) == ["mkdir", "-p", f"{tmp_path}/logs/my-tpu"]
  assert collect.startswith("for w in $(seq 0 $(($(gcloud compute tpus tpu-vm describe my-tpu ")
  assert (
      f'scp --recurse my-tpu:grpo_jax_logs/r1 {tmp_path}/logs/my-tpu --worker="$w" '
      f"{shlex.join(gc)}; done"
  ) in collect


def test_tpu_pod_usage_errors(tmp_path):
  _run(tmp_path, "tpu_pod.sh", "my-tpu", rc=2)
  _run(tmp_path, "tpu_pod.sh", "my-tpu", "zone", "--config=x.py", rc=2)  # args need the --
  _run(tmp_path, "tpu_pod.sh", "a", "b", "c", "d", "--", rc=2)


_FAKE_GCLOUD = r"""#!/usr/bin/env bash
# Stand-in gcloud: a 2-worker TPU VM whose workers are $FAKE/worker-{0,1} (their $HOME).
set -euo pipefail
printf '%s\n' "$*" >> "$FAKE/calls"
[ "$1 $2 $3" = "compute tpus tpu-vm" ] || exit 9
verb=$4; shift 4; pos=(); worker=0; cmd=""
while [ $# -gt 0 ]; do
  case "$1" in
    --worker=*) worker=${1#*=} ;;
    --zone|--project|--format) shift ;;
    --command) cmd=$2; shift ;;
    --recurse|--zone=*|--project=*|--format=*) ;;
    *) pos+=("$1") ;;
  esac; shift
done
workers=(0 1); [ "$worker" = all ] || workers=("$worker")
case $verb in
  describe) echo 2 ;;
  scp) for w in "${workers[@]}"; do
         h=$FAKE/worker-$w; s=${pos[0]}; d=${pos[1]}
         if [[ $d == *:* ]]; then cp -r "$s" "$h/${d#*:}"; else cp -r "$h/${s#*:}" "$d"; fi
       done ;;
  ssh) pids=()
       for w in "${workers[@]}"; do
         (cd "$FAKE/worker-$w" && HOME=$PWD PATH=$PWD/bin:$PATH exec bash -c "$cmd") & pids+=($!)
       done
       rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc ;;
esac
"""
_FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stand-in python3.12: `-m venv DIR` makes DIR/bin/python, which records pip and grpo_jax.main.
[ "$1 $2" = "-m venv" ] || exit 9
echo "$HOME" >> "$FAKE/venvs"; mkdir -p "$3/bin"
cat > "$3/bin/python" <<'EOS'
#!/usr/bin/env bash
test -f grpo_jax/main.py || exit 8
if [ "$1 $2" = "-m pip" ]; then shift 2; printf '%s\n' "$@" > "$HOME/pip_args"; exit 0; fi
shift 2; printf '%s\n' "$@" > "$HOME/main_args"; echo "main ran on $(hostname)"
for a in "$@"; do [ "$a" = --fail ] && exit 3; done; exit 0
EOS
chmod +x "$3/bin/python"
"""


def test_tpu_pod_end_to_end_with_a_stand_in_gcloud(tmp_path):
  fake = tmp_path / "fake"
  (fake / "bin").mkdir(parents=True)
  for name, text in (("gcloud", _FAKE_GCLOUD), ("py312", _FAKE_PYTHON)):
    (fake / "bin" / name).write_text(text)
    (fake / "bin" / name).chmod(0o755)
  for w in range(2):
    (fake / f"worker-{w}" / "bin").mkdir(parents=True)
    (fake / f"worker-{w}" / "bin" / "hostname").write_text(f"#!/bin/sh\necho host-{w}\n")
    (fake / f"worker-{w}" / "bin" / "hostname").chmod(0o755)
  env = dict(FAKE=str(fake), PATH=f"{fake}/bin:{os.environ['PATH']}")

  def launch(run_name, *args, rc=0):
    return _run(
        tmp_path,
        "tpu_pod.sh",
        "my-tpu",
        "zone-a",
        "--python",
        "py312",
        "--run_name",
        run_name,
        "--",
        *args,
        rc=rc,
        **env,
    )

  launch("r1", *ARGS)
  for w in range(2):
    home = fake / f"worker-{w}"
    assert (home / "main_args").read_text().splitlines() == ["--distributed", *ARGS]
    pip = (home / "pip_args").read_text().splitlines()
    assert pip == ["install", "-q", "-e", ".[tpu,gcs]", "-c", "requirements/constraints.txt"]
    assert (
        tmp_path / "logs/my-tpu/r1" / f"worker-host-{w}.log"
    ).read_text() == f"main ran on host-{w}\n"
    assert not (home / "grpo_jax.tgz").exists() and not (home / "grpo_jax.new").exists()
    _assert_code_only(
        {
            str(p.relative_to(home / "grpo_jax"))
            for p in (home / "grpo_jax").rglob("*")
            if p.is_file()
        }
    )
  # Again: the code dir is replaced (a stale file goes), the venv kept; a failing run still
  # brings its logs back and its exit status out.
  (fake / "worker-0/grpo_jax/stale.py").write_text("")
  launch("r2", "--fail", rc=3)
  assert not (fake / "worker-0/grpo_jax/stale.py").exists()
  assert len((fake / "venvs").read_text().splitlines()) == 2  # once per worker
  assert sorted(os.listdir(tmp_path / "logs/my-tpu/r2")) == [
      "worker-host-0.log",
      "worker-host-1.log",
  ]
  assert not [p for p in tmp_path.iterdir() if p.name.startswith("grpo_jax_tpu_pod.")]


def test_xpk_dry_run(tmp_path):
  p = _run(
      tmp_path,
      "xpk.sh",
      "--cluster",
      "c1",
      "--tpu-type",
      "v5p-8",
      "--num-slices",
      "2",
      "--project",
      "proj",
      "--zone=us-east5-a",
      "--workload",
      "w1",
      "--spot",
      "--priority",
      "high",
      "--dry_run",
      "--",
      *ARGS,
  )
  mkdir, stage, xpk = p.stdout.splitlines()
  xpk = shlex.split(xpk)
  assert xpk[:3] == ["xpk", "workload", "create"]
  for flag, value in (
      ("--cluster", "c1"),
      ("--workload", "w1"),
      ("--tpu-type", "v5p-8"),
      ("--num-slices", "2"),
      ("--project", "proj"),
      ("--zone", "us-east5-a"),
      ("--base-docker-image", "python:3.12"),
  ):
    assert _after(xpk, flag) == value
  assert xpk[-3:] == ["--spot", "--priority", "high"]  # unknown options go to xpk as they are
  # The script dir: the git-tracked files, staged (dry run too) under $TMPDIR.
  app = _after(xpk, "--script-dir")
  assert shlex.split(mkdir) == ["mkdir", "-p", app] and app.startswith(str(tmp_path))
  assert "git ls-files -z" in stage and stage.endswith(f"| tar -xf - -C {app}")
  _assert_code_only(
      {os.path.relpath(os.path.join(d, f), app) for d, _, files in os.walk(app) for f in files}
  )
  command = _after(xpk, "--command")
  assert command.startswith(
      'cd /app && python -m pip install -q -e ".[tpu,gcs]" '
      "-c requirements/constraints.txt && python -m grpo_jax.main "
  )
  assert _main_args(command) == ["--distributed", *ARGS]
  assert "--config.mesh.dcn_data=2" in p.stderr  # a hint only: never added to the args
  assert "dcn_data" not in command


def test_xpk_docker_image_and_errors(tmp_path):
  p = _run(
      tmp_path,
      "xpk.sh",
      "--cluster=c1",
      "--tpu-type=v6e-16",
      "--docker-image",
      "gcr.io/p/i",
      "--dry_run",
      "--",
      *ARGS,
      "--config.mesh.dcn_data=1",
  )
  (xpk,) = _lines(p)
  assert _after(xpk, "--docker-image") == "gcr.io/p/i" and _after(xpk, "--num-slices") == "1"
  assert "--script-dir" not in xpk and "--base-docker-image" not in xpk
  assert _main_args(_after(xpk, "--command")) == [
      "--distributed",
      *ARGS,
      "--config.mesh.dcn_data=1",
  ]
  assert "hint" not in p.stderr
  _run(tmp_path, "xpk.sh", "--tpu-type", "v5p-8", "--dry_run", "--", rc=2)  # no --cluster
  _run(
      tmp_path,
      "xpk.sh",
      "--cluster",
      "c",
      "--tpu-type",
      "v5p-8",
      "--docker-image",
      "a",
      "--base-docker-image",
      "b",
      "--dry_run",
      rc=2,
  )
  _run(
      tmp_path,
      "xpk.sh",
      "--cluster",
      "c",
      "--tpu-type",
      "v5p-8",
      "--num-slices",
      "0",
      "--dry_run",
      rc=2,
  )


def test_xpk_submits_the_staged_code(tmp_path):
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "xpk").write_text(
      '#!/usr/bin/env bash\nd=""; for a in "$@"; do '
      '[ "$p" = --script-dir ] && d=$a; p=$a; done\n'
      f'{sys.executable} -c "import json,sys; print(json.dumps(sys.argv[1:]))" "$@" '
      '> "$OUT"; ls "$d" >> "$OUT"\n'
  )
  (fake / "xpk").chmod(0o755)
  out = tmp_path / "out"
  _run(
      tmp_path,
      "xpk.sh",
      "--cluster",
      "c1",
      "--tpu-type",
      "v5litepod-16",
      "--",
      *ARGS,
      PATH=f"{fake}:{os.environ['PATH']}",
      OUT=str(out),
  )
  argv, *listing = out.read_text().splitlines()
  argv = json.loads(argv)
  assert _main_args(_after(argv, "--command")) == ["--distributed", *ARGS]
  assert {"grpo_jax", "configs", "setup.py", "requirements"} <= set(listing)
  assert not os.path.exists(_after(argv, "--script-dir"))  # removed once xpk is done


def test_slurm_dry_run(tmp_path):
  script = os.path.join(ROOT, "launch", "slurm.sbatch")
  p = _run(tmp_path, "slurm.sbatch", "--dry_run", *ARGS)
  assert _lines(p) == [
      [
          "srun",
          "--kill-on-bad-exit=1",
          f"{ROOT}/.venv/bin/python",
          "-m",
          "grpo_jax.main",
          "--distributed",
          *ARGS,
      ]
  ]
  p = _run(
      tmp_path,
      "slurm.sbatch",
      "--dry_run",
      "--",
      *ARGS,
      PYTHON="/opt/py/bin/python",
      SLURM_SUBMIT_DIR="/shared/repo",
  )
  assert _lines(p)[0][2] == "/opt/py/bin/python"
  assert subprocess.run(["bash", "-n", script]).returncode == 0


def test_multihost_dry_run(tmp_path):
  p = _run(tmp_path, "multihost.sh", "10.0.0.1:1234", "2", "1", "--dry_run", "--", *ARGS)
  assert _lines(p) == [
      ["cd", ROOT],
      [
          f"{ROOT}/.venv/bin/python",
          "-m",
          "grpo_jax.main",
          "--coordinator_address=10.0.0.1:1234",
          "--num_processes=2",
          "--process_id=1",
          *ARGS,
      ],
  ]
  p = _run(
      tmp_path,
      "multihost.sh",
      "h:1",
      "2",
      "0",
      "--dry_run",
      "--config=configs/tiny.py",
      LOCAL_DEVICES="4",
      PYTHON="py",
  )
  assert _lines(p)[1] == [
      "JAX_PLATFORMS=cpu",
      "XLA_FLAGS= --xla_force_host_platform_device_count=4",
      "py",
      "-m",
      "grpo_jax.main",
      "--coordinator_address=h:1",
      "--num_processes=2",
      "--process_id=0",
      "--config=configs/tiny.py",
  ]


@pytest.mark.parametrize("script", ["tpu_pod.sh", "xpk.sh", "slurm.sbatch", "multihost.sh"])
def test_scripts_parse(script):
  assert subprocess.run(["bash", "-n", os.path.join(ROOT, "launch", script)]).returncode == 0


# A launcher's own flag after `--` would be passed on to grpo_jax while the launch runs for real:
# each script refuses it in one line, naming where it goes, before anything runs (a stand-in for
# every command it could run records any call).
_RECORDER = '#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0") $*" >> "$CALLS"\n'


@pytest.mark.parametrize(
    "script,argv,where",
    [
        ("tpu_pod.sh", ["my-tpu", "zone-a", "--", *ARGS, "--dry_run"], "before --"),
        ("tpu_pod.sh", ["my-tpu", "zone-a", "--", "--run_name", "r1", *ARGS], "before --"),
        (
            "xpk.sh",
            ["--cluster", "c", "--tpu-type", "v5p-8", "--", "--dry_run", *ARGS],
            "before --",
        ),
        ("xpk.sh", ["--cluster=c", "--tpu-type=v5p-8", "--", *ARGS, "--workload=w"], "before --"),
        ("slurm.sbatch", [*ARGS, "--dry_run"], "first argument"),
        ("slurm.sbatch", ["--", "--dry_run", *ARGS], "first argument"),
        ("multihost.sh", ["h:1", "2", "0", "--", *ARGS, "--dry_run"], "right after PROCESS_ID"),
        ("multihost.sh", ["--dry_run", "h:1", "2", "0", "--", *ARGS], "right after PROCESS_ID"),
    ],
)
def test_a_launcher_flag_after_the_separator_is_refused_before_anything_runs(
    tmp_path, script, argv, where
):
  fake = tmp_path / "bin"
  fake.mkdir()
  for name in ("gcloud", "xpk", "srun", "python", "tar"):
    (fake / name).write_text(_RECORDER)
    (fake / name).chmod(0o755)
  calls = tmp_path / "calls"
  p = _run(
      tmp_path,
      script,
      *argv,
      rc=2,
      PATH=f"{fake}:{os.environ['PATH']}",
      CALLS=str(calls),
      PYTHON=str(fake / "python"),
  )
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and where in lines[0] and "usage:" in lines[0], p.stderr
  assert lines[0].startswith(f"launch/{script}: ")
  assert not calls.exists() and not p.stdout  # nothing ran, nothing printed as a dry run
  assert not [f for f in os.listdir(tmp_path) if f.startswith("grpo_jax_")]  # no staging dir


@pytest.mark.parametrize("script", ["tpu_pod.sh", "xpk.sh"])
def test_the_usage_line_says_where_the_launcher_flags_go(tmp_path, script):
  usage = _run(tmp_path, script, "--help").stdout
  assert "[--dry_run]" in usage and "before --" in usage and "grpo_jax.main" in usage
