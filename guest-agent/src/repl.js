// Tine's persistent Node.js interpreter, driven by the guest agent.
//
// Run as `node --expose-internals -e <this file> -- REQUESTS REPLIES`: the
// agent's pipes on fds REQUESTS (read) and REPLIES (write), reopened here
// close-on-exec (through /proc/self/fd) so that the cells' child
// processes do not inherit them. At start it writes {"ready": true} on its
// own line (the agent waits for it with its own deadline). Then one JSON
// request per line: {"code": str, "value_limit": int, "env"?: {"set":
// {name: value}, "unset": [name]}} runs a cell (its "limit" is the
// agent's: it caps the output it reads); one JSON reply per line:
// {"value", "value_bytes", "value_truncated", "exception", "timed_out"}.
//
// Fds 1 and 2 are pipes the agent reads: what the cell, its child
// processes and late callbacks write there is the running cell's stdout
// and stderr (the agent caps and counts them). process.stdout and
// process.stderr write them synchronously (fs.writeSync), so a cell's
// output is in the pipes, in order with its children's, before its reply;
// fd 0 is /dev/null.
//
// A cell runs as a vm.Script in this (the main) context: top-level
// declarations live on in the script scope, as in Node's own REPL. A cell
// with top-level `await` is rewritten as Node's REPL does it (its
// declarations hoisted out of an async function). A cell's last
// expression is its value (util.inspect, strings whole, cut at
// value_limit bytes); a promise (or thenable) is awaited first. At its
// timeout the agent sends SIGINT: synchronous code is interrupted
// (breakOnSigint) and an await is abandoned (the promise runs on); the
// state is kept. Errors thrown in callbacks and unhandled rejections are
// written to stderr. The event loop runs between cells, so servers and
// timers a cell starts keep running.
'use strict';
{
  const fs = require('fs');
  const net = require('net');
  const util = require('util');
  const vm = require('vm');
  const { Writable } = require('stream');

  const CELL = '<cell>';
  const INTERRUPTED = Symbol('interrupted');
  const pause = new Int32Array(new SharedArrayBuffer(4));

  function reopen(fd, flags) {
    try {
      const copy = fs.openSync(`/proc/self/fd/${fd}`, flags);
      fs.closeSync(fd);
      return copy;
    } catch {
      // No /proc: keep the inherited fd (the cells' children get it too).
      return fd;
    }
  }

  const requestFd = reopen(Number(process.argv[1]), fs.constants.O_RDONLY);
  const replyFd = reopen(Number(process.argv[2]), fs.constants.O_WRONLY);
  process.argv.splice(1, 2);

  // Writes all of `buf` to `fd`, waiting out a full pipe (EAGAIN: a child
  // may have made the shared pipe non-blocking). False if the fd is gone.
  function writeAll(fd, buf) {
    let off = 0;
    while (off < buf.length) {
      try {
        off += fs.writeSync(fd, buf, off, buf.length - off);
      } catch (e) {
        if (e.code === 'EAGAIN' || e.code === 'EINTR') {
          Atomics.wait(pause, 0, 0, 1);
          continue;
        }
        return false;
      }
    }
    return true;
  }

  // process.stdout and process.stderr: synchronous writes to fds 1 and 2.
  for (const [name, fd] of [['stdout', 1], ['stderr', 2]]) {
    const stream = new Writable({
      write(chunk, _encoding, callback) {
        writeAll(fd, chunk);
        callback();
      },
    });
    stream.fd = fd;
    stream.isTTY = false;
    stream.on('error', () => {});
    Object.defineProperty(process, name, { configurable: true, enumerable: true, get: () => stream });
  }

  function safe(f, fallback) {
    try {
      return f();
    } catch {
      return fallback;
    }
  }

  // `s` as well-formed UTF-8 (lone surrogates replaced).
  function utf8(s) {
    return Buffer.from(String(s), 'utf8');
  }

  // The first `limit` bytes of UTF-8 `b`, cut on a character boundary.
  function cut(b, limit) {
    if (b.length <= limit) return b;
    let end = limit;
    while (end > 0 && (b[end] & 0xc0) === 0x80) end--;
    return b.subarray(0, end);
  }

  // `s` cut to `limit` bytes, its whole length in bytes, whether it was cut.
  function cappedText(s, limit) {
    const b = utf8(s);
    const part = cut(b, limit);
    return [part.toString('utf8'), b.length, part.length < b.length];
  }

  // `s` cut to `limit` bytes (its head, or with `tail` its end), with a
  // note of how long it was.
  function marked(s, limit, tail) {
    const b = utf8(s);
    if (b.length <= limit) return b.toString('utf8');
    if (tail) {
      let start = b.length - limit;
      while (start < b.length && (b[start] & 0xc0) === 0x80) start++;
      return `[... cut: ${b.length} bytes in all]\n` + b.subarray(start).toString('utf8');
    }
    return cut(b, limit).toString('utf8') + `\n[... cut: ${b.length} bytes in all]`;
  }

  // An error's stack without this file's frames: up to the last frame in
  // a cell, or (no cell frame) without the vm's and this file's frames.
  function trimStack(stack) {
    const lines = String(stack).split('\n');
    const frame = (l) => /^\s+at /.test(l);
    let last = -1;
    lines.forEach((l, i) => {
      if (frame(l) && l.includes(CELL)) last = i;
    });
    const internal = /\[eval\]|\(node:|at node:/;
    return lines.filter((l, i) => !frame(l) || (last >= 0 ? i <= last : !internal.test(l))).join('\n');
  }

  function typeName(v) {
    if (v === null) return 'null';
    if (typeof v !== 'object' && typeof v !== 'function') return typeof v;
    return safe(() => v.constructor.name, '') || typeof v;
  }

  // {name, message, traceback} of a thrown value.
  function describe(e) {
    const stack = safe(() => e.stack, undefined);
    if (e !== null && typeof e === 'object' && typeof stack === 'string') {
      return {
        name: safe(() => String(e.name), '') || typeName(e),
        message: safe(() => String(e.message), '<String() of the message failed>'),
        traceback: trimStack(stack),
      };
    }
    const message = typeof e === 'string' ? e : safe(() => util.inspect(e), '<util.inspect() failed>');
    return { name: typeName(e), message, traceback: '' };
  }

  function report(what, e) {
    const d = describe(e);
    writeAll(2, utf8(`${what}: ${d.traceback || `${d.name}: ${d.message}`}\n`));
  }

  // An error thrown in a callback or a promise nobody awaits goes to the
  // running cell's stderr (or nowhere between cells), not to a crash.
  process.on('uncaughtException', (e) => report('Uncaught', e));
  process.on('unhandledRejection', (e) => report('Unhandled rejection', e));

  // Set while a cell awaits: SIGINT (the cell's timeout) abandons the await.
  let interrupt = null;
  process.on('SIGINT', () => {
    if (interrupt !== null) interrupt();
  });

  function interruptible(promise) {
    return new Promise((resolve, reject) => {
      interrupt = () => reject(INTERRUPTED);
      Promise.resolve(promise).then(resolve, reject);
    }).finally(() => {
      interrupt = null;
    });
  }

  // Node's REPL rewrite for top-level await (an internal module: without
  // it, only a returned promise is awaited).
  const topLevelAwait = safe(() => require('internal/repl/await').processTopLevelAwait, null);
  // import() in a cell: Node's own loader where this Node has the option
  // (its one experimental-feature warning, about the agent's choice, is
  // not the cell's), else a callback (older Node).
  let importDynamically = (specifier) => import(specifier);
  const mainLoader = vm.constants && vm.constants.USE_MAIN_CONTEXT_DEFAULT_LOADER;
  if (mainLoader !== undefined) {
    importDynamically = mainLoader;
    const emitWarning = process.emitWarning;
    process.emitWarning = function (warning, ...rest) {
      if (String(safe(() => warning.message || warning, '')).includes('USE_MAIN_CONTEXT_DEFAULT_LOADER')) return;
      return emitWarning.call(this, warning, ...rest);
    };
  }

  function isThenable(v) {
    return v !== null && (typeof v === 'object' || typeof v === 'function') && typeof v.then === 'function';
  }

  async function runCell(req) {
    const limit = req.value_limit || 65536;
    let value = null;
    let valueBytes = 0;
    let valueTruncated = false;
    let exception = null;
    let timedOut = false;
    try {
      let code = req.code;
      let wrapped = false;
      if (topLevelAwait !== null && code.includes('await')) {
        // A syntax error here is reported by the compile below.
        const w = safe(() => topLevelAwait(code), null);
        if (w !== null) {
          code = w;
          wrapped = true;
        }
      }
      const script = new vm.Script(code, { filename: CELL, importModuleDynamically: importDynamically });
      let result = script.runInThisContext({ breakOnSigint: true });
      if (wrapped) {
        // The rewrite returns `{ value: (last expression) }`, or nothing.
        result = await interruptible(result);
        const boxed = code.includes('return { value: (') && result !== null && typeof result === 'object';
        result = boxed ? result.value : result;
      } else if (isThenable(result)) {
        result = await interruptible(result);
      }
      if (result !== undefined) {
        [value, valueBytes, valueTruncated] = cappedText(util.inspect(result, { maxStringLength: Infinity }), limit);
      }
    } catch (e) {
      if (e === INTERRUPTED || safe(() => e.code, undefined) === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') {
        timedOut = true;
        exception = { name: 'Interrupted', message: 'the cell was interrupted at its timeout', traceback: '' };
      } else {
        exception = describe(e);
      }
    }
    if (exception !== null) {
      exception = {
        name: marked(exception.name, 256, false),
        message: marked(exception.message, limit, false),
        traceback: marked(exception.traceback, limit, true),
      };
    }
    return {
      value,
      value_bytes: valueBytes,
      value_truncated: valueTruncated,
      exception,
      timed_out: timedOut,
    };
  }

  function reply(msg) {
    if (!writeAll(replyFd, Buffer.from(JSON.stringify(msg) + '\n', 'utf8'))) process.exit(0);
  }

  function applyEnv(env) {
    // The sandbox environment changed (set_env): before the cell, so the
    // cell and the processes it starts see it.
    for (const name of env.unset) delete process.env[name];
    Object.assign(process.env, env.set);
  }

  const queue = [];
  let busy = false;
  async function serve() {
    if (busy) return;
    busy = true;
    while (queue.length > 0) {
      const line = queue.shift();
      let req;
      try {
        req = JSON.parse(line);
      } catch (e) {
        reply({ exception: { name: 'ProtocolError', message: String(e), traceback: '' }, timed_out: false });
        continue;
      }
      if (req.env) applyEnv(req.env);
      reply(await runCell(req));
    }
    busy = false;
  }

  const input = new net.Socket({ fd: requestFd, readable: true, writable: false });
  input.setEncoding('utf8');
  let pending = '';
  input.on('data', (chunk) => {
    pending += chunk;
    let nl;
    while ((nl = pending.indexOf('\n')) >= 0) {
      queue.push(pending.slice(0, nl));
      pending = pending.slice(nl + 1);
    }
    serve();
  });
  // The agent closed the requests: it is gone or discards this interpreter.
  input.on('end', () => process.exit(0));
  input.on('error', () => process.exit(0));

  reply({ ready: true });
}
