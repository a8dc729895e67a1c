# Tine's persistent Python interpreter, driven by the guest agent.
# At start it writes {"ready": true} on its own line (the agent waits for
# it with its own deadline, apart from any cell's timeout). Then one JSON
# request per line on stdin: {"code": str, "limit": int, "value_limit": int}
# runs a cell, {"warm": true} runs the warm-up (nothing in the cells'
# namespace changes); one JSON reply per line on stdout. Cell output goes
# to bounded buffers, not to the protocol pipe; fds 1 and 2 point at
# /dev/null for child processes.
import ast, gc, json, os, signal, sys, traceback

proto_in = os.fdopen(os.dup(0), "rb")
proto_out = os.fdopen(os.dup(1), "wb")
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(devnull, fd)


def cut_utf8(b, limit):
    """The first `limit` bytes of UTF-8 `b`, cut on a character boundary."""
    if len(b) <= limit:
        return b
    end = limit
    # Back off over continuation bytes (10xxxxxx) to a character start.
    while end > 0 and (b[end] & 0xC0) == 0x80:
        end -= 1
    return b[:end]


class CappedBytes:
    """The binary side (`sys.stdout.buffer`) of a Capped stream."""

    def __init__(self, text):
        self.text = text

    def write(self, b):
        self.text.add(bytes(b))
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
        self.add(s.encode("utf-8", "replace"))
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
    json.dumps({"value": None, "stdout": out.result()})
    del scratch, tree, last, out
    gc.collect()


ns = {"__name__": "__main__", "__builtins__": __builtins__}
real_out, real_err = sys.stdout, sys.stderr


def reply(msg):
    proto_out.write(json.dumps(msg).encode() + b"\n")
    proto_out.flush()


signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    value_limit = req.get("value_limit", 65536)
    out, err = Capped(req["limit"]), Capped(req["limit"])
    value, value_bytes, value_truncated, exc, timed_out = None, 0, False, None, False
    sys.stdout, sys.stderr = out, err
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
    if exc is not None:
        exc["message"] = marked(exc["message"], value_limit)
        exc["traceback"] = marked(exc["traceback"], value_limit, tail=True)
    reply({"value": value, "value_bytes": value_bytes, "value_truncated": value_truncated, "stdout": out.result(),
           "stderr": err.result(), "exception": exc, "timed_out": timed_out})
