# Tine's persistent Python interpreter, driven by the guest agent.
# One JSON request per line on stdin: {"code": str, "limit": int}; one JSON
# reply per line on stdout. Cell output goes to bounded buffers, not to the
# protocol pipe; fds 1 and 2 point at /dev/null for child processes.
import ast, json, os, signal, sys, traceback

proto_in = os.fdopen(os.dup(0), "rb")
proto_out = os.fdopen(os.dup(1), "wb")
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(devnull, fd)


class Capped:
    """A text stream keeping the first `limit` bytes (UTF-8) it is given."""

    def __init__(self, limit):
        self.limit, self.kept, self.total = limit, bytearray(), 0

    def write(self, s):
        b = s.encode("utf-8", "replace")
        self.total += len(b)
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += b[:room]
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False

    def result(self):
        return {"data": self.kept.decode("utf-8", "replace"), "truncated": self.total > len(self.kept), "total_bytes": self.total}


ns = {"__name__": "__main__", "__builtins__": __builtins__}
real_out, real_err = sys.stdout, sys.stderr

while True:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = proto_in.readline()
    if not line:
        break
    req = json.loads(line)
    out, err = Capped(req["limit"]), Capped(req["limit"])
    value, exc, timed_out = None, None, False
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
                value = repr(v)
    except KeyboardInterrupt as e:
        timed_out = True
        exc = {"name": "KeyboardInterrupt", "message": "the cell was interrupted at its timeout", "traceback": traceback.format_exc()}
    except BaseException as e:
        exc = {"name": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout, sys.stderr = real_out, real_err
    reply = {"value": value, "stdout": out.result(), "stderr": err.result(), "exception": exc, "timed_out": timed_out}
    proto_out.write(json.dumps(reply).encode() + b"\n")
    proto_out.flush()
