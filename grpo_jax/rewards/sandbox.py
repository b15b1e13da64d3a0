"""The sandbox the code reward runs completions in (grpo_jax/rewards/code.py says what is
scored; this file how it is contained: the scorer's side here, what runs inside the box in
sandbox_launcher.py).

    res = run_sandboxed(program, tests, timeout_sec=5.0)  # SandboxResult: passed, total, mode
    res = run_sandboxed(code, [], capture_bytes=4096)     # + res.stdout, res.stderr (the python tool)
    sandbox_info()                                         # which OS guards work on this machine

One completion = one fresh process tree, started and torn down by the scoring process:

  scorer --(new session, env {HOME,TMPDIR}=workdir, cwd workdir)--> launcher L:
      `python -I -S -B -X utf8 sandbox_launcher.py --launch`; it sets up namespaces, forks C, kills C at the
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

import json
import os
import signal
import sys
import time

from grpo_jax.rewards.sandbox_launcher import NOBODY

DEFAULT_TIMEOUT_SEC = 5.0
MEMORY_BYTES = 1 << 30  # RLIMIT_AS
FILE_BYTES = 10 << 20  # RLIMIT_FSIZE
NPROC = 16  # RLIMIT_NPROC (processes + threads)
NOFILE = 64  # RLIMIT_NOFILE
GRACE_SEC = 3.0  # the scorer's backstop beyond timeout_sec (interpreter start-up)
MAX_REPORT_BYTES = 1 << 20  # what the scorer reads from the result pipe at most
MAX_WORKERS = 16  # concurrent sandboxes in a batch


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
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
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
