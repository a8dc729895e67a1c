# Tine's persistent Python interpreter, driven by the guest agent.
# At start it writes {"ready": true} on its own line (the agent waits for
# it with its own deadline, apart from any cell's timeout). Then one JSON
# request per line on stdin: {"code": str, "limit": int, "value_limit": int}
# runs a cell, {"warm": true} runs the warm-up (nothing in the cells'
# namespace changes); one JSON reply per line on stdout. Cell output goes
# to bounded buffers, not to the protocol pipe. Fds 1 and 2 are pipes read
# by FdCapture, so what child processes (os.system, subprocess) and C code
# write there lands in the running cell's stdout/stderr; fd 0 is /dev/null.
import ast, gc, json, os, select, signal, sys, threading, traceback

proto_in = os.fdopen(os.dup(0), "rb")
proto_out = os.fdopen(os.dup(1), "wb")
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 0)


def cut_utf8(b, limit):
    """The first `limit` bytes of UTF-8 `b`, cut on a character boundary."""
    if len(b) <= limit:
        return b
    end = limit
    # Back off over continuation bytes (10xxxxxx) to a character start.
    while end > 0 and (b[end] & 0xC0) == 0x80:
        end -= 1
    return b[:end]


class FdCapture:
    """Pipes over fds 1 and 2 whose bytes go to the running cell's Capped
    streams (or nowhere between cells). A daemon thread drains them as
    they fill, so a child never blocks on a full pipe; every Python-level
    write first drains what is already in the pipes, so a cell's
    `print("a"); os.system("echo b"); print("c")` keeps its order. A
    background child left by an earlier cell writes into whichever cell
    runs when its bytes arrive."""

    def __init__(self):
        # Reentrant: a signal handler or a finalizer that prints may run on
        # the main thread while it holds the lock.
        self.lock = threading.RLock()
        self.fds, self.targets = [], {}
        for fd in (1, 2):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.fds.append(r)
            self.targets[r] = None
        self.by_fd = dict(zip((1, 2), self.fds))
        threading.Thread(target=self.pump, name="fd-capture", daemon=True).start()
        os.register_at_fork(after_in_child=self.forked)

    @staticmethod
    def forked():
        """In a child forked by Python (os.fork, multiprocessing): no pump
        thread and a lock copied in any state, so its prints go straight to
        fds 1 and 2, whose bytes the parent's pump takes."""
        global capture
        capture = None
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__

    def drain_locked(self, r):
        # At most 1 MiB per call: a child writing as fast as this reads must
        # not keep the lock (and the cell's prints) forever.
        for _ in range(16):
            try:
                b = os.read(r, 65536)
            except BlockingIOError:
                return
            if not b:
                return
            target = self.targets[r]
            if target is not None:
                target.add(b)

    def sync_locked(self):
        ready, _, _ = select.select(self.fds, [], [], 0)
        for r in ready:
            self.drain_locked(r)

    def pump(self):
        while True:
            ready, _, _ = select.select(self.fds, [], [])
            with self.lock:
                for r in ready:
                    self.drain_locked(r)

    def begin(self, out, err):
        """Routes fd 1 to `out` and fd 2 to `err` (after discarding what
        arrived between cells)."""
        with self.lock:
            self.sync_locked()
            self.targets[self.by_fd[1]], self.targets[self.by_fd[2]] = out, err

    def finish(self):
        """Takes what the cell's children wrote and stops routing."""
        sys.__stdout__.flush()
        sys.__stderr__.flush()
        with self.lock:
            self.sync_locked()
            for r in self.fds:
                self.targets[r] = None


capture = None


class CappedBytes:
    """The binary side (`sys.stdout.buffer`) of a Capped stream."""

    def __init__(self, text):
        self.text = text

    def write(self, b):
        b = bytes(b)
        if capture is None:
            self.text.add(b)
        else:
            with capture.lock:
                capture.sync_locked()
                self.text.add(b)
        return len(b)

    def flush(self):
        pass


class Capped:
    """A text stream keeping the first `limit` bytes (UTF-8) it is given,
    cut on a character boundary, and counting all of them."""

    encoding = "utf-8"

    def __init__(self, limit):
        self.limit, self.kept, self.total, self.full = limit, bytearray(), 0, False
        self.buffer = CappedBytes(self)

    def add(self, b):
        self.total += len(b)
        room = self.limit - len(self.kept)
        if self.full or room <= 0:
            self.full = True
            return
        part = cut_utf8(b, room)
        self.kept += part
        if len(part) < len(b):
            self.full = True

    def write(self, s):
        b = s.encode("utf-8", "replace")
        if capture is None:
            self.add(b)
        else:
            with capture.lock:
                capture.sync_locked()
                self.add(b)
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False

    def result(self):
        return {"data": self.kept.decode("utf-8", "replace"), "truncated": self.total > len(self.kept), "total_bytes": self.total}


def capped_text(s, limit):
    """`s` cut to `limit` UTF-8 bytes, its whole length in bytes, and
    whether it was cut."""
    b = s.encode("utf-8", "replace")
    part = cut_utf8(b, limit)
    return part.decode("utf-8", "replace"), len(b), len(part) < len(b)


def marked(s, limit, tail=False):
    """`s` cut to `limit` bytes (its head, or with `tail` its end), with a
    note of how long it was."""
    b = s.encode("utf-8", "replace")
    if len(b) <= limit:
        return s
    if tail:
        start = len(b) - limit
        while start < len(b) and (b[start] & 0xC0) == 0x80:
            start += 1
        return f"[... cut: {len(b)} bytes in all]\n" + b[start:].decode("utf-8", "replace")
    return cut_utf8(b, limit).decode("utf-8", "replace") + f"\n[... cut: {len(b)} bytes in all]"


def warm_up():
    """Runs the paths a cell takes (parse, compile, exec, eval, repr, a
    traceback, JSON) in a namespace of its own, so their code and data
    are faulted in before a template snapshot. Imports nothing new: a
    module seeded at import (random) would share its seed with every
    sandbox restored from the snapshot."""
    scratch = {"__name__": "__warmup__", "__builtins__": __builtins__}
    tree = ast.parse("x = [i * 2 for i in range(100)]\ny = {'k': x}\ny", "<warm-up>", "exec")
    last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<warm-up>", "exec"), scratch)
    capped_text(repr(eval(compile(last, "<warm-up>", "eval"), scratch)), 1024)
    try:
        exec(compile("1 / 0", "<warm-up>", "exec"), scratch)
    except ZeroDivisionError:
        traceback.format_exc()
    out = Capped(1024)
    print("warm", file=out)
    capture.begin(out, out)
    os.write(1, b"warm")
    capture.finish()
    json.dumps({"value": None, "stdout": out.result()})
    del scratch, tree, last, out
    gc.collect()


ns = {"__name__": "__main__", "__builtins__": __builtins__}
real_out, real_err = sys.stdout, sys.stderr


def reply(msg):
    proto_out.write(json.dumps(msg).encode() + b"\n")
    proto_out.flush()


signal.signal(signal.SIGINT, signal.SIG_IGN)
capture = FdCapture()
reply({"ready": True})

while True:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = proto_in.readline()
    if not line:
        break
    req = json.loads(line)
    if req.get("warm"):
        warm_up()
        reply({"warm": True})
        continue
    env = req.get("env")
    if env is not None:
        # The sandbox environment changed (set_env): before the cell, so
        # the cell and the processes it starts see it.
        for name in env["unset"]:
            os.environ.pop(name, None)
        os.environ.update(env["set"])
    value_limit = req.get("value_limit", 65536)
    out, err = Capped(req["limit"]), Capped(req["limit"])
    value, value_bytes, value_truncated, exc, timed_out = None, 0, False, None, False
    sys.stdout, sys.stderr = out, err
    capture.begin(out, err)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        tree = ast.parse(req["code"], "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            v = eval(compile(last, "<cell>", "eval"), ns)
            if v is not None:
                ns["_"] = v
                value, value_bytes, value_truncated = capped_text(repr(v), value_limit)
    except KeyboardInterrupt as e:
        timed_out = True
        exc = {"name": "KeyboardInterrupt", "message": "the cell was interrupted at its timeout", "traceback": traceback.format_exc()}
    except BaseException as e:
        try:
            message = str(e)
        except BaseException:
            message = "<str() of the exception failed>"
        exc = {"name": type(e).__name__, "message": message, "traceback": traceback.format_exc()}
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout, sys.stderr = real_out, real_err
        capture.finish()
    if exc is not None:
        exc["message"] = marked(exc["message"], value_limit)
        exc["traceback"] = marked(exc["traceback"], value_limit, tail=True)
    reply({"value": value, "value_bytes": value_bytes, "value_truncated": value_truncated, "stdout": out.result(),
           "stderr": err.result(), "exception": exc, "timed_out": timed_out})
