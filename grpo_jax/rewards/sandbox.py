"""The sandbox the code reward runs completions in (grpo_jax/rewards/code.py says what is
scored; this file how it is contained).

    res = run_sandboxed(program, tests, timeout_sec=5.0)  # SandboxResult: passed, total, mode
    res = run_sandboxed(code, [], capture_bytes=4096)     # + res.stdout, res.stderr (the python tool)
    sandbox_info()                                         # which OS guards work on this machine

One completion = one fresh process tree, started and torn down by the scoring process:

  scorer --(new session, env {HOME,TMPDIR}=workdir, cwd workdir)--> launcher L: this file run as
      `python -I -S -B -X utf8 sandbox.py --launch`; it sets up namespaces, forks C, kills C at the
      wall-clock deadline. L's own stdout (which C closes first thing) reports to the scorer.
  L --fork--> C: PID 1 of a new PID namespace when available, in its own process group; mounts
      a fresh /proc, drops privileges, sets rlimits, installs the audit hook, then runs program
      and tests. Results go to a pipe as lines tagged with a random nonce that C reads from a
      pipe the program never sees; lines without it are ignored.

L SIGKILLs C's process group when C is done or at the deadline (with a PID namespace, C's death
ends everything in it). The scorer waits at most timeout_sec + a few seconds of grace, then
SIGKILLs L's process group and every process left in L's session (L is reaped only afterwards,
so neither id can have been reused); C has PR_SET_PDEATHSIG = SIGKILL, so it (and its namespace)
also dies with L. The workdir is removed. A SIGALRM the caller arms around score() (the reward
computer's in-process timeout) ends the run early, after this clean-up.

Guards, and who enforces them ("OS" = the kernel, whatever the program does; "audit" = a
sys.addaudithook hook in C, always installed, which raises PermissionError):

  time      OS: wall clock (L kills C; the scorer kills L's group as a backstop), RLIMIT_CPU
            (soft int(timeout)+2 s, hard +1 s). Per test: SIGALRM (a program can defeat it,
            then the wall clock applies and the tests reported so far count).
  memory    OS: RLIMIT_AS (1 GiB default). files: OS: RLIMIT_FSIZE (10 MiB), RLIMIT_NOFILE (64).
  output    OS: stdout/stderr are /dev/null; nothing the program prints reaches the scorer.
            With capture_bytes > 0 (the python tool, grpo_jax/rollout/tools/builtin.py) they are
            instead two unlinked files the scorer created and holds open: no path names them,
            RLIMIT_FSIZE caps them (a write past it fails: Python ignores SIGXFSZ), and the
            scorer reads back at most capture_bytes of each through its own descriptors once C
            is dead.
  processes audit: os.fork/exec/spawn/system/posix_spawn, subprocess, and imports of
            _posixsubprocess (its fork_exec raises no audit event) are blocked. OS: RLIMIT_NPROC
            (16; it counts threads too). RLIMIT_NPROC is per user: it is counted per sandbox only
            inside the sandbox's own user namespace ("nproc_per_sandbox" in the mode); without
            one it counts all processes of that user, and it never applies to real root (which
            is why root drops to uid/gid 65534 before running anything). With a PID namespace
            every process the program makes dies with C.
  parent    OS with a PID namespace: C is PID 1 and sees no process outside (getppid() == 0;
            kill(0, ...) reaches only its own process group, whose PID 1 ignores it). Always:
            the program's parent is the disposable launcher, never the scorer, which runs in
            another session; as root the program's uid (65534) may not signal either. audit:
            os.kill of anything but itself, os.killpg.
  network   OS with a network namespace (only a down loopback: even 127.0.0.1 is unreachable).
            audit: every socket.* event (socket creation, connect, bind, getaddrinfo, ...).
  files     OS with a mount namespace: every mount is re-mounted read-only (bind remounts, per
            mount, private propagation so nothing reaches the host) except the workdir, which
            is bind-mounted read-write, and /proc, which C replaces with a fresh procfs of its
            PID namespace. OS as root: the program runs as uid 65534, so it can only write where
            "other" may (e.g. /tmp without a mount namespace); directories closed to others that
            hold the standard library (a Python under /root) are covered by a tmpfs with the
            library bound back, which hides the rest of them. Otherwise writes outside the
            workdir are only guarded by the OS user's permissions. audit: opening for writing,
            mkdir/remove/rename/link/symlink/chmod/chown/utime/truncate/xattrs outside the
            workdir, dir_fd-relative calls, os.open with a relative path (its dir_fd is not
            reported), opening anything under /proc; and os.mkfifo/os.mknod (which raise no
            audit event) are replaced by stubs. Reading other files is not restricted beyond
            the OS user's permissions (and, as root, the tmpfs cover above).
  secrets   The program's environment is {HOME, TMPDIR} = its workdir (plus the LC_CTYPE that
            Python's own locale coercion adds). The scorer's environment
            is out of reach: other /proc entries are hidden by the PID namespace's /proc, owned
            by another uid when root dropped privileges, and /proc reads are audit-blocked.
  result    Only lines tagged with the nonce count, so printing or writing "test 0 pass" (even
            to the result fd) does nothing. C compiles program and tests first, then runs them
            with its helpers bound to locals (exec, os.write, the exception classes), so
            patching builtins or modules cannot fake a pass. audit: gc.get_objects/referrers/
            referents, sys.settrace/setprofile/_current_frames, setting __code__, ctypes and
            /proc/self/mem. The nonce still sits in the runner's frame, and sys._getframe cannot
            be blocked (enum, namedtuple and dataclasses call it), so a program that walks
            frames on purpose can forge results: the tag stops accidents and naive hacks, not a
            determined adversary. Likewise `assert f(x) == y` is passed by an f that returns an
            object whose __eq__ is always True: the tests decide what counts.

Audit hooks are a best-effort layer: they see only what CPython reports, and code that reaches
raw syscalls (ctypes, which the hook blocks, or a C extension) bypasses them. The OS layers
depend on the machine: `sandbox_info()` probes once per process which ones work (user, network,
PID and mount namespaces via os.unshare; uid drop as root) and every run uses the strongest
available, falling back step by step (and saying so in the run's `mode`) if a step fails:

  root:      unshare(NET|NS|PID) as real root, then drop to uid 65534 and enter a nested user
             namespace (so RLIMIT_NPROC counts per sandbox and the mounts are locked).
  non-root:  unshare(USER|NET|NS|PID) mapping the user to root of the namespace; C enters a
             nested user namespace so it holds no capability over the mount namespace.
  neither:   no namespaces (e.g. a container whose seccomp policy forbids unshare, or Ubuntu's
             AppArmor restriction of unprivileged user namespaces): rlimits + uid drop (root
             only) + audit hook. Then writes outside the workdir, network, and signals to
             same-user processes are guarded only by the audit hook and the OS user. As root
             with a standard library closed to others and no mount namespace, uid 65534 can
             import only the modules in _PRELOAD (imported before the drop).

"""

# This file is also the launcher script: keep module-level imports to the standard library and
# light (the launcher imports it under `python -I -S`; subprocess, socket and ctypes must not
# be imported here, or the program would find them already loaded).
import json
import os
import signal
import sys
import time

DEFAULT_TIMEOUT_SEC = 5.0
MEMORY_BYTES = 1 << 30  # RLIMIT_AS
FILE_BYTES = 10 << 20  # RLIMIT_FSIZE
NPROC = 16  # RLIMIT_NPROC (processes + threads)
NOFILE = 64  # RLIMIT_NOFILE
NOBODY = 65534  # the uid/gid root drops to
GRACE_SEC = 3.0  # the scorer's backstop beyond timeout_sec (interpreter start-up)
MAX_REPORT_BYTES = 1 << 20  # what the scorer reads from the result pipe at most
MAX_WORKERS = 16  # concurrent sandboxes in a batch


# Linux constants (os.CLONE_* exist on 3.12; the mount flags have no Python names).
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = (
    0x00020000,
    0x10000000,
    0x20000000,
    0x40000000,
)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_MOUNT_OPTS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
# Imported before root drops to uid 65534 when the standard library is not readable by others
# (e.g. a Python under /root) and no mount namespace can expose it.
_PRELOAD = (
    "math",
    "cmath",
    "collections",
    "heapq",
    "bisect",
    "itertools",
    "functools",
    "operator",
    "string",
    "re",
    "random",
    "fractions",
    "decimal",
    "statistics",
    "typing",
    "dataclasses",
    "copy",
    "datetime",
    "json",
    "array",
    "enum",
    "numbers",
    "textwrap",
    "unicodedata",
    "struct",
    "hashlib",
    "queue",
    "io",
)


# ============================================================================ scorer side


class SandboxResult:
  """What one sandboxed run did. `score` = passed / total (0 if it did not load)."""

  def __init__(self, **kw):
    self.passed = 0  # tests passed (only counted when the program loaded)
    self.total = 0  # tests given
    self.loaded = False  # the program ran to completion before the tests
    self.load_error = None  # exception type name of a failed load
    self.test_errors = {}  # {test index: exception type name or "timeout"}
    self.timed_out = False  # the wall clock ran out (L killed C, or the scorer killed L)
    self.elapsed = 0.0  # seconds, scorer's clock, start of L to clean-up done
    self.mode = {}  # which guards were in place (launcher + child reports)
    self.launcher_pid = None  # host pid of L (== its process group and session id)
    self.workdir = None  # the private directory (removed when the run ends)
    self.setup_error = None  # the sandbox itself failed (not the program)
    self.stdout = self.stderr = ""  # with capture_bytes: the first capture_bytes of each
    self.stdout_size = self.stderr_size = 0  # with capture_bytes: bytes the program wrote
    self.__dict__.update(kw)

  @property
  def score(self) -> float:
    return self.passed / self.total if (self.total and self.loaded) else 0.0

  def __repr__(self):
    keys = ("passed", "total", "loaded", "load_error", "timed_out", "elapsed", "setup_error")
    return "SandboxResult(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in keys) + ")"


_INFO = None


def sandbox_info() -> dict:
  """Which OS guards work here: probed once per process by running a trivial sandbox."""
  global _INFO
  if _INFO is None:
    probe = ("import fractions\nx = 1", ["assert x == 1"])
    res = run_sandboxed(*probe, timeout_sec=10.0, namespaces=True)
    if res.setup_error or res.score != 1.0:  # something in the namespace set-up went wrong
      first = f"{res!r} {res.mode}"
      res = run_sandboxed(*probe, timeout_sec=10.0, namespaces=False)
      if res.setup_error or res.score != 1.0:
        raise RuntimeError(
            f"code reward: the sandbox does not work here: {first}; without "
            f"namespaces: {res!r} {res.mode}"
        )
    _INFO = dict(res.mode)
    if not _INFO.get("pidns") or not _INFO.get("netns"):
      import logging

      logging.getLogger(__name__).warning(
          "code reward sandbox without namespaces (%s): network, files and signals are guarded "
          "only by the audit hook and the OS user",
          _INFO,
      )
  return _INFO


def run_sandboxed(
    program: str,
    tests,
    *,
    timeout_sec: float = DEFAULT_TIMEOUT_SEC,
    memory_bytes: int = MEMORY_BYTES,
    file_bytes: int = FILE_BYTES,
    nproc: int = NPROC,
    audit: bool = True,
    namespaces="auto",
    capture_bytes: int = 0,
) -> SandboxResult:
  """Runs `program` then each of `tests` in one fresh sandbox; the detailed result.

  namespaces: "auto" (the probed strongest mode), True (try them), or False (none: rlimits,
  uid drop and the audit hook only). audit=False leaves out the audit hook (to test the OS
  layers alone); never use it for real scoring. capture_bytes > 0: the program's stdout and
  stderr (unbuffered) come back in res.stdout / res.stderr, at most that many bytes of each."""
  import secrets
  import shutil
  import subprocess
  import tempfile
  import threading

  tests = [str(t) for t in tests]
  timeout_sec = float(timeout_sec)
  if namespaces == "auto":  # skip the attempts where the probe found none
    namespaces = bool(sandbox_info().get("netns"))
  res = SandboxResult(total=len(tests))
  root = os.geteuid() == 0
  nonce = secrets.token_hex(16)
  fds = []
  proc = workdir = None
  start = time.monotonic()
  # A caller's timer (the reward computer's SIGALRM; Python runs handlers in the main thread
  # only) must not raise inside set-up, wait or clean-up (a launcher started but not recorded,
  # or a clean-up cut short, would leak): for the whole run its handler is swapped for one that
  # only records. A recorded alarm ends the wait early; after the clean-up the caller's handler
  # is put back and the signal raised again. (Blocking the signal is not enough: a handler that
  # CPython has already marked due runs at the next bytecode boundary anyway.)
  main = threading.current_thread() is threading.main_thread()
  due = []
  record = lambda signum, frame: due.append(signum)  # noqa: E731
  caller = signal.signal(signal.SIGALRM, record) if main else None  # may raise: nothing yet
  try:
    workdir = res.workdir = os.path.realpath(tempfile.mkdtemp(prefix="grpo_code_"))
    if root:
      os.chown(workdir, NOBODY, NOBODY)
    nonce_r, nonce_w = os.pipe()
    fds += [nonce_r, nonce_w]
    os.write(nonce_w, nonce.encode())
    os.close(nonce_w)
    fds.remove(nonce_w)
    result_r, result_w = os.pipe()
    fds += [result_r, result_w]
    output_fds = []
    if capture_bytes > 0:  # unlinked at once: only descriptors reach them
      for name in ("stdout", "stderr"):
        path = os.path.join(workdir, f".{name}.{nonce}")
        output_fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        fds.append(output_fds[-1])
        os.unlink(path)
    cfg = {
        "program": program,
        "tests": tests,
        "workdir": workdir,
        "timeout": timeout_sec,
        "memory": int(memory_bytes),
        "fsize": int(file_bytes),
        "nproc": int(nproc),
        "nofile": NOFILE,
        "audit": bool(audit),
        "namespaces": bool(namespaces),
        "result_fd": result_w,
        "nonce_fd": nonce_r,
        "output_fds": output_fds,
        "uid": os.getuid(),
        "gid": os.getgid(),
    }
    launcher = os.path.abspath(__file__)
    if launcher.endswith((".pyc", ".pyo")):
      launcher = launcher[:-1]
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", "-X", "utf8", launcher, "--launch"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=workdir,
        env={"HOME": workdir, "TMPDIR": workdir},
        pass_fds=(result_w, nonce_r, *output_fds),
        start_new_session=True,
        close_fds=True,
    )
    res.launcher_pid = proc.pid
    for fd in (result_w, nonce_r):
      os.close(fd)
      fds.remove(fd)
    try:
      proc.stdin.write(json.dumps(cfg).encode())
      proc.stdin.close()
    except OSError:
      pass  # L died at start: reported below
    report = _read_report(proc, result_r, start + timeout_sec + GRACE_SEC, due)
    _finish(proc, start + timeout_sec + GRACE_SEC, res, due)
    if output_fds:  # C and everything it started are dead: nothing writes any more
      (res.stdout, res.stdout_size), (res.stderr, res.stderr_size) = (
          _read_output(fd, capture_bytes) for fd in output_fds
      )
  finally:
    for fd in fds:
      try:
        os.close(fd)
      except OSError:
        pass
    if proc is not None and proc.returncode is None:
      _kill_group(proc)
      proc.wait()
    if workdir:
      shutil.rmtree(workdir, ignore_errors=True)
    if main:
      signal.signal(signal.SIGALRM, caller)
      if due:
        signal.raise_signal(signal.SIGALRM)  # the caller's handler (or default action) now
  if due:
    raise RuntimeError("code reward: interrupted by SIGALRM")  # the caller's handler returned
  res.elapsed = time.monotonic() - start
  _parse(res, report, nonce, len(tests))
  return res


def _read_report(proc, fd, deadline, due) -> bytes:
  """Everything C writes to the result pipe, until EOF (all writers gone), the launcher's exit
  with the pipe drained, the deadline, or a caller's alarm (`due`)."""
  import select

  poller = select.poll()  # not select(): a trainer's fds may be numbered past FD_SETSIZE
  poller.register(fd, select.POLLIN)
  buf = bytearray()
  exited_at = None
  while not due:
    now = time.monotonic()
    if now >= deadline:
      break
    if exited_at is None and _exited(proc.pid):
      exited_at = now
    if exited_at is not None and now - exited_at > 0.2:
      break  # L is gone and nothing more came: a straggler may hold the pipe open
    if poller.poll(int(min(0.05, deadline - now) * 1000) + 1):
      chunk = os.read(fd, 65536)
      if not chunk:
        break
      if len(buf) < MAX_REPORT_BYTES:
        buf += chunk[: MAX_REPORT_BYTES - len(buf)]
  return bytes(buf)


def _read_output(fd, limit) -> tuple[str, int]:
  """(the first `limit` bytes of a capture file as text, the bytes written to it)."""
  size = os.fstat(fd).st_size
  return os.pread(fd, min(limit, size), 0).decode("utf-8", "replace"), size


def _exited(pid) -> bool:
  """Whether the child `pid` has exited, without reaping it (its pid and process group id
  stay reserved until we reap, so killing the group later cannot hit a stranger)."""
  try:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:
    return True


def _kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _finish(proc, deadline, res, due) -> bytes:
  """Waits for L until the deadline (or a caller's alarm), kills what is left of its group and
  session, reaps L, and returns L's stdout."""
  while not due and not _exited(proc.pid) and time.monotonic() < deadline:
    time.sleep(0.01)
  if not due and not _exited(proc.pid):
    res.timed_out = True
  _kill_group(proc)  # L, if still there (not reaped yet: its pid cannot have been reused)
  while not _exited(proc.pid):
    time.sleep(0.005)
  out = b""
  fd = proc.stdout.fileno()
  os.set_blocking(fd, False)
  try:
    while len(out) < 65536:
      chunk = os.read(fd, 65536)
      if not chunk:
        break
      out += chunk
  except OSError:  # BlockingIOError: nothing more now
    pass
  _parse_launcher(res, out)
  # Always: C (in its own group, same session) may have lost L before it set PR_SET_PDEATHSIG;
  # killing C (PID 1 of its namespace) ends the namespace too.
  _kill_session(proc.pid)
  proc.stdout.close()
  proc.wait()
  return out


def _kill_session(sid):
  """SIGKILLs every process whose session id is `sid` but `sid` itself (C and, without a PID
  namespace, whatever the program started and did not move to a session of its own)."""
  try:
    entries = os.listdir("/proc")
  except OSError:
    return
  for name in entries:
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
      continue
    if len(fields) > 3 and int(fields[3]) == sid and int(name) != sid:
      try:
        os.kill(int(name), signal.SIGKILL)
      except OSError:
        pass


def _parse_launcher(res, launcher_out: bytes):
  for line in launcher_out.decode("utf-8", "replace").splitlines():
    kind, _, rest = line.partition(" ")
    try:
      payload = json.loads(rest)
    except ValueError:
      continue
    if kind == "setup":
      res.mode.update(payload)
    elif kind == "error":
      res.setup_error = payload
    elif kind == "end" and payload.get("timed_out"):
      res.timed_out = True
  if "started" not in res.mode and not res.setup_error:
    res.setup_error = "the launcher exited without starting the program"


def _parse(res, report: bytes, nonce: str, n: int):
  tag = nonce + " "
  passed = set()
  for line in report.decode("utf-8", "replace").splitlines():
    if not line.startswith(tag):
      continue
    parts = line[len(tag) :].split(" ")
    if parts[0] == "info":
      try:
        res.mode.update(json.loads(" ".join(parts[1:])))
      except ValueError:
        pass
    elif parts[0] == "load":
      res.loaded = parts[1:2] == ["ok"]
      if not res.loaded:
        res.load_error = parts[2] if len(parts) > 2 else "?"
    elif parts[0] == "test" and len(parts) >= 3 and parts[1].isdigit() and int(parts[1]) < n:
      if parts[2] == "pass":
        passed.add(int(parts[1]))
      else:
        res.test_errors[int(parts[1])] = parts[3] if len(parts) > 3 else "?"
    elif parts[0] == "fatal":
      res.setup_error = " ".join(parts[1:])
  res.passed = len(passed) if res.loaded else 0


# ============================================================================ launcher (L)


def _out(kind, payload):
  os.write(1, f"{kind} {json.dumps(payload)}\n".encode())


def _launcher_main():
  signal.pthread_sigmask(signal.SIG_SETMASK, set())  # the scorer's mask is inherited: clear it
  cfg = json.loads(sys.stdin.buffer.read())
  devnull = os.open("/dev/null", os.O_RDWR)
  os.dup2(devnull, 0)
  os.close(devnull)
  try:
    mode = _setup_namespaces(cfg) if cfg["namespaces"] else {"requested": False}
    _out("setup", mode)
    cfg["t0"] = time.monotonic()  # CLOCK_MONOTONIC: the same clock in L and C
    pid = os.fork()
    if pid == 0:
      try:
        _child_main(cfg, mode)
      finally:
        os._exit(70)
    try:
      os.setpgid(pid, pid)  # also done in C: whichever runs first
    except OSError:
      pass
    _out("setup", {"started": True})
    for fd in (cfg["result_fd"], cfg["nonce_fd"], *cfg["output_fds"]):
      os.close(fd)
    timed_out = _wait_child(pid, cfg["t0"] + cfg["timeout"])
    _out("end", {"timed_out": timed_out})
  except BaseException as e:  # noqa: BLE001 -- report anything to the scorer
    _out("error", f"{type(e).__name__}: {e}")
  os._exit(0)


def _wait_child(pid, deadline) -> bool:
  """Waits for C until the deadline, then SIGKILLs its process group -- before reaping C, so
  the group id cannot have been reused. With a PID namespace C's death ends everything in it."""
  import select

  try:
    pidfd = os.pidfd_open(pid)
  except (AttributeError, OSError):
    pidfd = None
  timed_out = False
  while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
    left = deadline - time.monotonic()
    if left <= 0:
      timed_out = True
      break
    if pidfd is not None:
      poller = select.poll()
      poller.register(pidfd, select.POLLIN)
      poller.poll(int(left * 1000) + 1)
    else:
      time.sleep(min(left, 0.01))
  for kill, target in ((os.killpg, pid), (os.kill, pid)):
    try:
      kill(target, signal.SIGKILL)
    except OSError:
      pass
  os.waitpid(pid, 0)
  return timed_out


_LIBC = []


def _libc():
  if not _LIBC:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
    ]
    _LIBC.append((libc, ctypes))
  return _LIBC[0]


def _mount(source, target, fstype, flags, data=None):
  libc, ctypes = _libc()
  enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
  if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), target)


def _write_file(path, text):
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _setup_namespaces(cfg) -> dict:
  """In L: new network/mount/PID (and, not as root, user) namespaces, and a read-only view of
  every mount but the workdir. Best effort; the returned dict says what holds."""
  mode = {
      "requested": True,
      "userns": False,
      "netns": False,
      "pidns": False,
      "mntns": False,
      "readonly": False,
      "notes": [],
  }
  notes = mode["notes"]
  if not hasattr(os, "unshare"):
    notes.append("os.unshare unavailable")
    return mode
  root = os.geteuid() == 0
  base = (0 if root else _CLONE_NEWUSER) | _CLONE_NEWNET
  for flags in (base | _CLONE_NEWNS | _CLONE_NEWPID, base | _CLONE_NEWPID, base):
    try:
      os.unshare(flags)
      break
    except OSError as e:
      notes.append(f"unshare({flags:#x}): {e.strerror}")
  else:
    return mode
  mode.update(
      userns=bool(flags & _CLONE_NEWUSER),
      netns=True,
      pidns=bool(flags & _CLONE_NEWPID),
      mntns=bool(flags & _CLONE_NEWNS),
  )
  if mode["userns"]:
    try:
      _write_file("/proc/self/setgroups", "deny")
      _write_file("/proc/self/uid_map", f"0 {cfg['uid']} 1")
      _write_file("/proc/self/gid_map", f"0 {cfg['gid']} 1")
    except OSError as e:
      notes.append(f"id maps: {e}")
  if mode["mntns"]:
    try:
      mode["readonly"] = _readonly_except(cfg["workdir"], notes, expose=root)
      mode["stdlib_exposed"] = root
    except OSError as e:
      notes.append(f"mounts: {e}")
  return mode


def _closed_ancestor(path):
  """The outermost proper ancestor of `path` that others may not enter (no o+x), or None."""
  parts = path.strip("/").split("/")
  for i in range(len(parts)):
    p = "/" + "/".join(parts[:i])
    try:
      if not os.stat(p).st_mode & 0o001:
        return p
    except OSError:
      return None
  return None


def _stdlib_dirs():
  return [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]


def _expose(dirs, notes):
  """Root runs the program as uid 65534: where a directory it needs (the standard library, the
  workdir) lies under one closed to others (e.g. /root), put a tmpfs over that ancestor -- which
  also hides the rest of it -- and bind-mount the needed directories back at their paths."""
  by_ancestor = {}
  for d in dirs:
    anc = _closed_ancestor(d)
    if anc and anc != "/":
      by_ancestor.setdefault(anc, set()).add(d)
  for anc, ds in by_ancestor.items():
    keep = sorted(d for d in ds if not any(d != o and d.startswith(o + "/") for o in ds))
    fds = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in keep]  # before hiding them
    try:
      _mount("tmpfs", anc, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=1m")
      for d, fd in zip(keep, fds):
        os.makedirs(d, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", d, None, _MS_BIND | _MS_REC)
    finally:
      for fd in fds:
        os.close(fd)
    notes.append(f"tmpfs over {anc}, bound back: {', '.join(keep)}")


def _mountinfo():
  """(mount point, per-mount options) of every mount, outermost first."""
  import re

  out = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      fields = line.split()
      point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
      out.append((point, fields[5].split(",")))
  return out


def _readonly_except(workdir, notes, expose) -> bool:
  # Nothing below may ever reach the host's mount table: make every mount private first, and
  # stop if that fails (a bind mount on a shared mount would propagate to its peers).
  _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
  if expose:
    _expose(_stdlib_dirs() + [workdir], notes)
  _mount(workdir, workdir, None, _MS_BIND)
  failed = []
  for point, opts in _mountinfo():
    if point == workdir or point == "/proc" or point.startswith("/proc/"):
      continue  # the workdir stays writable; C mounts a fresh /proc over the old one
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY  # MS_BIND: this mount only, not the fs
    for o in opts:
      flags |= _MOUNT_OPTS.get(o, 0)  # keep the (possibly locked) nosuid/nodev/noexec/atime
    try:
      _mount(None, point, None, flags)
    except OSError as e:
      failed.append(f"{point}: {e.strerror}")
  if failed:
    notes.append("not read-only: " + "; ".join(failed[:8]))
  return not any(f.startswith("/: ") for f in failed)


# =============================================================================== child (C)


def _child_main(cfg, mode):
  """In C (PID 1 of the new PID namespace when there is one): isolate, then run."""
  # Its own process group (same session): kill(0, ...) cannot reach L, and L can end the whole
  # group. Then close L's stdout (the scorer reads it until EOF) and everything else.
  os.setpgid(0, 0)
  devnull = os.open("/dev/null", os.O_RDWR)
  for fd in (0, 1, 2):
    os.dup2(devnull, fd)
  if cfg["output_fds"]:  # the scorer's capture files (run_sandboxed's capture_bytes)
    import io

    for fd, src in zip((1, 2), cfg["output_fds"]):
      os.dup2(src, fd)
    # Unbuffered: C ends with os._exit (and may be killed), which would lose a buffer.
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), "utf-8", "backslashreplace", write_through=True
        )
        for fd in (1, 2)
    )
  nonce = os.read(cfg["nonce_fd"], 64).decode()
  os.dup2(cfg["result_fd"], 3)
  os.closerange(4, 1 << 16)
  out = 3
  try:
    info = _isolate_child(cfg, mode)
  except BaseException as e:  # noqa: BLE001
    os.write(out, f"{nonce} fatal {type(e).__name__}: {e}\n".encode())
    os._exit(71)
  os.write(out, f"{nonce} info {json.dumps(info)}\n".encode())
  # The in-process alarms end a little before L's kill, so a timeout is reported as one.
  deadline = cfg["t0"] + cfg["timeout"] - min(0.2, 0.1 * cfg["timeout"])
  program, tests = cfg["program"], cfg["tests"]
  workdir, audit = cfg["workdir"], cfg["audit"]
  cfg.clear()
  mode.clear()
  box = [nonce]  # _run takes it out: no frame below the program's keeps the nonce
  del nonce
  _run(program, tests, box, out, deadline, workdir, audit)


def _isolate_child(cfg, mode) -> dict:
  import resource

  _libc()  # loaded while the standard library is certainly readable
  info = {"proc": False, "uid_drop": False, "nproc_per_sandbox": False, "pdeathsig": False}
  notes = []
  if mode.get("pidns") and mode.get("mntns"):
    try:
      _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
      info["proc"] = True
    except OSError as e:
      notes.append(f"mount /proc: {e.strerror}")
  uid = cfg["uid"]
  if os.geteuid() == 0 and not mode.get("userns"):  # real root: become nobody
    if not mode.get("stdlib_exposed") and any(_closed_ancestor(d) for d in _stdlib_dirs()):
      for name in _PRELOAD:  # uid 65534 will not be able to read the standard library
        try:
          __import__(name)
        except ImportError:
          pass
      notes.append("standard library closed to others: preloaded " + ",".join(_PRELOAD))
    try:
      os.setgroups([])
      os.setresgid(NOBODY, NOBODY, NOBODY)
      os.setresuid(NOBODY, NOBODY, NOBODY)
      info["uid_drop"] = True
      uid = NOBODY
    except OSError as e:
      notes.append(f"uid drop: {e}")
  # A nested user namespace: RLIMIT_NPROC then counts this sandbox only, and C holds no
  # capability over the mount namespace (it cannot undo the read-only mounts).
  try:
    if not cfg["namespaces"]:
      raise OSError("namespaces off")
    if os.geteuid() == 0 and not info["uid_drop"] and not mode.get("userns"):
      raise OSError("still real root")
    euid, egid = os.geteuid(), os.getegid()
    libc, _ = _libc()
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change made /proc/self root's
    os.unshare(_CLONE_NEWUSER)
    _write_file("/proc/self/setgroups", "deny")
    _write_file("/proc/self/uid_map", f"{uid} {euid} 1")
    _write_file("/proc/self/gid_map", f"{uid if info['uid_drop'] else cfg['gid']} {egid} 1")
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    info["nproc_per_sandbox"] = True
  except (OSError, AttributeError) as e:
    notes.append(f"nested user namespace: {e}")
  limits = [
      (resource.RLIMIT_AS, cfg["memory"]),
      (resource.RLIMIT_FSIZE, cfg["fsize"]),
      (resource.RLIMIT_NOFILE, cfg["nofile"]),
      (resource.RLIMIT_NPROC, cfg["nproc"]),
      (resource.RLIMIT_CORE, 0),
  ]
  cpu = int(cfg["timeout"]) + 2  # >= ceil(timeout) + 1
  resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
  for which, value in limits:
    resource.setrlimit(which, (value, value))
  try:  # after every credential change (they clear it); SIGKILL when L dies
    libc, _ = _libc()
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
      info["pdeathsig"] = True
  except (OSError, AttributeError) as e:
    notes.append(f"pdeathsig: {e}")
  os.chdir(cfg["workdir"])
  try:
    info["pidns_id"] = os.readlink("/proc/self/ns/pid")
  except OSError:
    pass
  info["uid"] = os.getuid()
  info["child_notes"] = notes
  # Nothing of ctypes may stay reachable from the program.
  _LIBC.clear()
  for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[name]
  import gc

  gc.collect()
  return info


class _TestTimeout(BaseException):
  pass


def _on_alarm(signum, frame):
  raise _TestTimeout()


def _run(program, tests, box, out, deadline, workdir, audit):
  """Compiles everything, installs the audit hook, runs the program, then each test with its
  share of the remaining time; one nonce-tagged line per outcome. Every helper used after the
  program starts is a local, so the program cannot replace it."""
  import builtins

  _write, _mono, _setitimer, _exit = os.write, time.monotonic, signal.setitimer, os._exit
  _exec, _type, _str, _len, _max, _range = exec, type, str, len, max, range
  _BE, _Timeout, REAL = BaseException, _TestTimeout, signal.ITIMER_REAL
  tag = box.pop() + " "

  def report(line):  # defined before the program runs; calls only locals
    try:
      _write(out, (tag + line + "\n").encode())
    except _BE:
      _exit(72)

  def name(e):
    try:
      return _str(_type.__dict__["__name__"].__get__(_type(e)))[:60].replace(" ", "_")
    except _BE:
      return "?"

  try:
    code = compile(program, "<solution>", "exec")
  except BaseException as e:  # noqa: BLE001
    report(f"load fail {name(e)}")
    _exit(0)
  compiled = []
  for i, t in enumerate(tests):
    try:
      compiled.append(compile(t, f"<test {i}>", "exec"))
    except BaseException as e:  # noqa: BLE001
      compiled.append(e)
  n = _len(compiled)
  g = {"__name__": "__solution__", "__builtins__": builtins}
  signal.signal(signal.SIGALRM, _on_alarm)
  if audit:
    _install_audit_hook(workdir)

  try:
    try:
      _setitimer(REAL, _max(deadline - _mono(), 0.001))
      _exec(code, g)
    finally:
      _setitimer(REAL, 0)
  except _BE as e:
    report("load fail " + ("timeout" if _type(e) is _Timeout else name(e)))
    _exit(0)
  report("load ok")
  for i in _range(n):
    c = compiled[i]
    if _type(c) is not _type(code):
      report(f"test {i} fail {name(c)}")
      continue
    try:
      try:
        _setitimer(REAL, _max((deadline - _mono()) / (n - i), 0.001))
        _exec(c, g)
      finally:
        _setitimer(REAL, 0)
    except _BE as e:
      report(f"test {i} fail " + ("timeout" if _type(e) is _Timeout else name(e)))
      continue
    report(f"test {i} pass")
  report("done")
  _exit(0)


def _install_audit_hook(workdir):
  """The audit layer (see the module docstring). Raises PermissionError for what it blocks."""
  import builtins

  fspath, getpid, getcwd, lstat, readlink = os.fspath, os.getpid, os.getcwd, os.lstat, os.readlink
  _isinstance, _int, _str, _bytes, _len = isinstance, int, str, bytes, len
  deny = PermissionError
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  blocked = frozenset(
      (
          "os.fork",
          "os.forkpty",
          "os.exec",
          "os.posix_spawn",
          "os.spawn",
          "os.system",
          "os.startfile",
          "subprocess.Popen",
          "pty.spawn",
          "os.killpg",
          "os.unshare",
          "os.setns",
          "sys._current_frames",
          "sys._current_exceptions",
          "sys.settrace",
          "sys.setprofile",
          "sys.remote_exec",
          "gc.get_objects",
          "gc.get_referrers",
          "gc.get_referents",
      )
  )
  deny_imports = frozenset(
      (
          "ctypes",
          "_ctypes",
          "_posixsubprocess",
          "_testcapi",
          "_testinternalcapi",
          "_testbuffer",
          "_xxsubinterpreters",
          "_xxinterpchannels",
          "_testsinglephase",
          "_testmultiphase",
          "_testclinic",
          "_testimportmultiple",
          "posix",
          "_signal",
      )
  )
  # event -> (indices of path arguments, indices of dir_fd arguments)
  path_events = {
      "os.mkdir": ((0,), (2,)),
      "os.rmdir": ((0,), (1,)),
      "os.remove": ((0,), (1,)),
      "os.rename": ((0, 1), (2, 3)),
      "os.link": ((0, 1), (2, 3)),
      "os.symlink": ((1,), (2,)),
      "os.truncate": ((0,), ()),
      "os.chmod": ((0,), (2,)),
      "os.chown": ((0,), (3,)),
      "os.utime": ((0,), (3,)),
      "os.setxattr": ((0,), ()),
      "os.removexattr": ((0,), ()),
      "os.chflags": ((0,), ()),
      "os.lchflags": ((0,), ()),
      "os.lchmod": ((0,), ()),
  }

  def realpath(path):
    """os.path.realpath with functions bound now (the program may patch os and posixpath)."""
    parts = ([] if path.startswith("/") else getcwd().split("/")[1:]) + path.split("/")
    done, hops = [], 0
    while parts:
      part = parts.pop(0)
      if part in ("", "."):
        continue
      if part == "..":
        if done:
          done.pop()
        continue
      cand = "/" + "/".join(done + [part])
      try:
        is_link = (lstat(cand).st_mode & 0o170000) == 0o120000
      except OSError:
        is_link = False
      if is_link and hops < 40:
        hops += 1
        target = readlink(cand)
        if target.startswith("/"):
          done = []
        parts = target.split("/") + parts
      else:
        done.append(part)
    return "/" + "/".join(done)

  root = realpath(workdir)

  def inside(p):
    r = realpath(p)
    return r == root or r.startswith(root + "/")

  def as_path(p):
    if _isinstance(p, _int):
      return None  # an open fd: already vetted when it was opened
    p = fspath(p)
    return p.decode("utf-8", "surrogateescape") if _isinstance(p, _bytes) else p

  def hook(event, args):
    if event in blocked or event.startswith(("socket.", "ctypes.")):
      raise deny(f"sandbox: {event} is not allowed")
    if event == "import":
      if _str(args[0]).split(".")[0] in deny_imports:
        raise deny(f"sandbox: importing {args[0]} is not allowed")
    elif event == "open":
      path, mode, flags = args
      path = as_path(path)
      if path is None:
        return
      if mode is None and not path.startswith("/"):  # os.open: its dir_fd is not reported
        raise deny("sandbox: os.open needs an absolute path")
      real = realpath(path)
      if real == "/proc" or real.startswith("/proc/"):
        raise deny(f"sandbox: opening {path} is not allowed")
      writes = (
          (flags & write_flags)
          if _isinstance(flags, _int)
          else (mode is not None and any(ch in _str(mode) for ch in "wax+"))
      )
      if writes and path != "/dev/null":
        if not (real == root or real.startswith(root + "/")):
          raise deny(f"sandbox: writing {path} is not allowed (only under {root})")
    elif event in path_events:
      paths, dir_fds = path_events[event]
      for i in dir_fds:
        if i < _len(args) and args[i] is not None and args[i] != -1 and args[i] != -100:
          raise deny(f"sandbox: {event} with dir_fd is not allowed")
      for i in paths:
        p = as_path(args[i]) if i < _len(args) else None
        if p is not None and not inside(p):
          raise deny(f"sandbox: {event} on {p} is not allowed (only under {root})")
    elif event == "os.kill":
      if args[0] != getpid():
        raise deny("sandbox: signalling other processes is not allowed")
    elif event == "object.__setattr__":
      if args[1] == "__code__":
        raise deny("sandbox: setting __code__ is not allowed")

  def no_special_files(*a, **k):
    raise deny("sandbox: creating FIFOs and device nodes is not allowed")

  for mod in (os, sys.modules.get("posix")):
    if mod is not None:
      for attr in ("mkfifo", "mknod"):
        if hasattr(mod, attr):
          setattr(mod, attr, no_special_files)
  del builtins
  sys.addaudithook(hook)


if __name__ == "__main__" and sys.argv[1:] == ["--launch"]:
  _launcher_main()
