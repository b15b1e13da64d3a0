"""What runs inside the code reward's sandbox: the launcher L and the child C that runs the
program and its tests (the process tree, the guards and who enforces each: sandbox.py's
docstring; the scorer's side, which starts L and reads its reports: sandbox.py).

    python -I -S -B -X utf8 sandbox_launcher.py --launch   # config on stdin, as run_sandboxed

L sets up the namespaces and forks C; C mounts its /proc, drops privileges, sets the rlimits,
installs the audit hook and runs program and tests, reporting nonce-tagged lines on a pipe.
"""

# This file is the launcher script: keep module-level imports to the standard library and light
# (it runs under `python -I -S`, without the package on its path; subprocess, socket and ctypes
# must not be imported here, or the program would find them already loaded).
import json
import os
import signal
import sys
import time

NOBODY = 65534  # the uid/gid root drops to

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
