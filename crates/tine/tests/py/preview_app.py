# The web app of tests/preview.rs and benches/benches/preview.rs, run in a
# thread of a sandbox's Python interpreter (sandbox_run_python): an
# HTTP/1.1 server on guest port 8000. /headers: what it was sent (JSON);
# /sse: one event, the second once /release is asked for (chunked); /ws: a
# WebSocket echo of text messages under 120 bytes until a close (RFC 6455);
# /blob?n=N: N bytes, byte i = i % 251; PUT /upload: the body's SHA-256;
# /count: requests seen but these; /cookies: a page that sets two cookies
# for the preview domain (`Domain=localhost`) and widens a service
# worker's scope to `/` (`Service-Worker-Allowed`); /: a page whose script sends a
# WebSocket message and shows the echo.
import base64, hashlib, http.server, json, threading, urllib.parse
app_seen = [0]
app_release = threading.Event()
APP_BLOCK = bytes(i % 251 for i in range(251 * 261))
APP_PAGE = b'''<!doctype html><title>app</title><p id=app>hello from the sandbox</p><p id=ws>waiting</p>
<script>
const ws = new WebSocket((location.protocol == 'https:' ? 'wss://' : 'ws://') + location.host + '/ws');
ws.onopen = () => ws.send('from the page');
ws.onmessage = (e) => { document.getElementById('ws').textContent = e.data; ws.close(); };
ws.onerror = () => { document.getElementById('ws').textContent = 'websocket error'; };
</script>'''
class AppHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def log_message(self, *a):
        pass
    def reply(self, code, body, ctype='text/plain'):
        self.send_response(code)
        self.send_header('Content-Type', ctype)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def chunk(self, data):
        self.wfile.write(b'%x\r\n%s\r\n' % (len(data), data))
        self.wfile.flush()
    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        if url.path != '/count':
            app_seen[0] += 1
        if url.path == '/count':
            self.reply(200, str(app_seen[0]).encode())
        elif url.path == '/headers':
            seen = {k.lower(): v for k, v in self.headers.items()}
            seen['target'] = self.path
            self.reply(200, json.dumps(seen).encode(), 'application/json')
        elif url.path == '/cookies':
            self.send_response(200)
            self.send_header('Set-Cookie', 'guest_a=1; Domain=localhost; Path=/')
            self.send_header('Set-Cookie', 'guest_b=2; Path=/; HttpOnly; domain=.LOCALHOST ; SameSite=Lax')
            self.send_header('Service-Worker-Allowed', '/')
            self.send_header('Content-Length', '2')
            self.end_headers()
            self.wfile.write(b'ok')
        elif url.path == '/release':
            app_release.set()
            self.reply(200, b'released')
        elif url.path == '/sse':
            self.send_response(200)
            self.send_header('Content-Type', 'text/event-stream')
            self.send_header('Transfer-Encoding', 'chunked')
            self.end_headers()
            self.chunk(b'data: one\n\n')
            app_release.wait(300)
            self.chunk(b'data: two\n\n')
            self.chunk(b'')
        elif url.path == '/ws':
            key = self.headers['Sec-WebSocket-Key']
            accept = base64.b64encode(hashlib.sha1((key + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11').encode()).digest())
            self.send_response(101)
            self.send_header('Upgrade', 'websocket')
            self.send_header('Connection', 'Upgrade')
            self.send_header('Sec-WebSocket-Accept', accept.decode())
            self.end_headers()
            self.wfile.flush()
            r = self.rfile
            while True:
                head = r.read(2)
                if len(head) < 2 or head[0] & 15 == 8:
                    break
                n = head[1] & 127
                if n == 126:
                    n = int.from_bytes(r.read(2), 'big')
                elif n == 127:
                    n = int.from_bytes(r.read(8), 'big')
                mask = r.read(4)
                data = bytes(c ^ mask[i % 4] for i, c in enumerate(r.read(n)))
                out = b'echo: ' + data
                self.wfile.write(bytes([0x81, len(out)]) + out)
                self.wfile.flush()
            self.wfile.write(bytes([0x88, 0]))
            self.wfile.flush()
            self.close_connection = True
        elif url.path == '/blob':
            n = int(urllib.parse.parse_qs(url.query)['n'][0])
            self.send_response(200)
            self.send_header('Content-Type', 'application/octet-stream')
            self.send_header('Content-Length', str(n))
            self.end_headers()
            while n > 0:
                piece = APP_BLOCK[:n]
                self.wfile.write(piece)
                n -= len(piece)
        else:
            self.reply(200, APP_PAGE, 'text/html')
    def do_PUT(self):
        app_seen[0] += 1
        n = int(self.headers['Content-Length'])
        h = hashlib.sha256()
        while n > 0:
            d = self.rfile.read(min(n, 1 << 16))
            if not d:
                break
            h.update(d)
            n -= len(d)
        self.reply(200, h.hexdigest().encode())
class AppServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
app_server = AppServer(('0.0.0.0', 8000), AppHandler)
threading.Thread(target=app_server.serve_forever, daemon=True).start()
