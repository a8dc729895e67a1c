"""The official MCP Python SDK's OAuth client against Tine, end to end.

Run by crates/tine/tests/oauth.rs against a real `tine server start` whose
`[auth.oauth]` names the authorization server this script runs:

    python oauth_sdk.py MCP_URL AS_PORT TENANT

It starts the authorization server, prints `AS READY` (the test then starts
Tine, whose configuration names it), waits for Tine's /healthz and runs
the client. The authorization server (Authlib, on 127.0.0.1:AS_PORT, issuer
http://127.0.0.1:AS_PORT/as) serves RFC 8414 metadata, dynamic client
registration (RFC 7591), the authorization code grant with PKCE S256 (RFC
7636) approved at once for one user, and JWT access tokens (RFC 9068)
whose `aud` is the requested resource (RFC 8707) and whose `tenant` claim
is TENANT, signed with an ES256 key whose JWK set it serves.

The client is `mcp.client.auth.OAuthClientProvider` with a redirect handler
that follows the authorization URL headless and a callback handler that
returns the code and state: it goes from the server's 401 through the
protected resource metadata (RFC 9728) and the authorization server's
metadata, registers, authorizes, exchanges the code and calls
`sandbox_list`. Every check prints `CHECK <name> ok`; the last line is
`ALL OK`. Any failure raises (exit status 1).
"""

import asyncio
import base64
import json
import logging
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

# Authlib refuses plain http unless told: this server is on loopback only.
os.environ["AUTHLIB_INSECURE_TRANSPORT"] = "1"

import httpx2  # noqa: E402  (the SDK's HTTP client)
from authlib.oauth2 import AuthorizationServer, OAuth2Request  # noqa: E402
from authlib.oauth2.rfc6749 import AuthorizationCodeMixin, ClientMixin, grants  # noqa: E402
from authlib.oauth2.rfc6749.errors import InvalidRequestError  # noqa: E402
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload, JsonPayload, JsonRequest  # noqa: E402
from authlib.oauth2.rfc7591 import ClientRegistrationEndpoint  # noqa: E402
from authlib.oauth2.rfc7636 import CodeChallenge  # noqa: E402
from authlib.oauth2.rfc8414 import AuthorizationServerMetadata  # noqa: E402
from authlib.oauth2.rfc9068 import JWTBearerTokenGenerator  # noqa: E402
from joserfc.jwk import ECKey, KeySet  # noqa: E402
from mcp import ClientSession  # noqa: E402
from mcp.client.auth import OAuthClientProvider  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientMetadata  # noqa: E402


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"CHECK {name} ok", flush=True)


# ---------------------------------------------------------------- the AS


class User:
    def get_user_id(self):
        return "alice"


USER = User()


class Client(ClientMixin):
    """A client registered with RFC 7591 (kept in memory)."""

    def __init__(self, info, metadata):
        self.client_id = info["client_id"]
        self.client_secret = info.get("client_secret")
        self.metadata = metadata

    def get_client_id(self):
        return self.client_id

    def get_default_redirect_uri(self):
        return self.metadata["redirect_uris"][0]

    def get_allowed_scope(self, scope):
        return scope or ""

    def check_redirect_uri(self, redirect_uri):
        return redirect_uri in self.metadata["redirect_uris"]

    def check_client_secret(self, client_secret):
        return self.client_secret is not None and client_secret == self.client_secret

    def check_endpoint_auth_method(self, method, endpoint):
        if endpoint == "token":
            return method == self.metadata.get("token_endpoint_auth_method", "client_secret_basic")
        return True

    def check_response_type(self, response_type):
        return response_type == "code"

    def check_grant_type(self, grant_type):
        return grant_type in self.metadata.get("grant_types", ["authorization_code"])


class Code(AuthorizationCodeMixin):
    def __init__(self, code, client_id, redirect_uri, scope, challenge, method, resource):
        self.code = code
        self.client_id = client_id
        self.redirect_uri = redirect_uri
        self.scope = scope
        self.code_challenge = challenge
        self.code_challenge_method = method
        self.resource = resource
        self.expires_at = time.time() + 300

    def get_redirect_uri(self):
        return self.redirect_uri

    def get_scope(self):
        return self.scope


class Request(OAuth2Request):
    """A request to the authorize or token endpoint: its query and, for a
    POST, its form (application/x-www-form-urlencoded)."""

    def __init__(self, method, url, headers, body):
        super().__init__(method, url, headers=headers)
        self._args = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
        self._form = {k: v[0] for k, v in parse_qs(body.decode()).items()} if method == "POST" else {}
        self.payload = BasicOAuth2Payload({**self._args, **self._form})

    @property
    def args(self):
        return self._args

    @property
    def form(self):
        return self._form


class AuthServer(AuthorizationServer):
    """Authlib's authorization server on the standard library's HTTP server:
    a request here is (method, url, headers, form or JSON body)."""

    def __init__(self, issuer, resource, tenant):
        super().__init__()
        self.issuer = issuer
        self.resource = resource
        self.clients = {}
        self.codes = {}
        self.key = ECKey.generate_key("P-256", parameters={"kid": "as-es256", "alg": "ES256", "use": "sig"})
        self.tokens_issued = 0

        server = self

        class Tokens(JWTBearerTokenGenerator):
            def get_jwks(self):
                return KeySet([server.key])

            def get_audiences(self, client, user, scope):
                # RFC 8707: the resource the client asked for, checked below.
                return server.resource

            def get_extra_claims(self, client, grant_type, user, scope):
                server.tokens_issued += 1
                return {"tenant": tenant}

        self.register_token_generator("default", Tokens(issuer, alg="ES256"))

        class CodeGrant(grants.AuthorizationCodeGrant):
            TOKEN_ENDPOINT_AUTH_METHODS = ["none", "client_secret_basic", "client_secret_post"]

            def save_authorization_code(self, code, request):
                data = request.payload.data
                server.codes[code] = Code(
                    code,
                    request.client.get_client_id(),
                    data.get("redirect_uri"),
                    request.scope,
                    data.get("code_challenge"),
                    data.get("code_challenge_method"),
                    data.get("resource"),
                )

            def query_authorization_code(self, code, client):
                c = server.codes.get(code)
                if c and c.client_id == client.get_client_id() and c.expires_at > time.time():
                    return c
                return None

            def delete_authorization_code(self, authorization_code):
                server.codes.pop(authorization_code.code, None)

            def authenticate_user(self, authorization_code):
                return USER

        self.register_grant(CodeGrant, [CodeChallenge(required=True)])

        class Registration(ClientRegistrationEndpoint):
            def authenticate_token(self, request):
                return True  # open registration (RFC 7591 §3)

            def get_server_metadata(self):
                return server.metadata()

            def save_client(self, client_info, client_metadata, request):
                client = Client(client_info, client_metadata)
                server.clients[client.client_id] = client
                return client

        self.register_endpoint(Registration)

    def query_client(self, client_id):
        return self.clients.get(client_id)

    def save_token(self, token, request):
        pass

    def send_signal(self, name, *args, **kwargs):
        pass

    def metadata(self):
        m = AuthorizationServerMetadata(
            {
                "issuer": self.issuer,
                "authorization_endpoint": self.issuer + "/authorize",
                "token_endpoint": self.issuer + "/token",
                "registration_endpoint": self.issuer + "/register",
                "jwks_uri": self.issuer + "/jwks",
                "response_types_supported": ["code"],
                "grant_types_supported": ["authorization_code"],
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": ["none", "client_secret_basic", "client_secret_post"],
            }
        )
        m.validate()
        return dict(m)

    def create_oauth2_request(self, request):
        method, url, headers, body = request
        return Request(method, url, headers, body)

    def create_json_request(self, request):
        method, url, headers, body = request
        req = JsonRequest(method, url, headers)

        class Payload(JsonPayload):
            @property
            def data(self):
                return json.loads(body or b"{}")

        req.payload = Payload()
        return req

    def handle_response(self, status, body, headers):
        if isinstance(body, dict):
            body = json.dumps(body)
        return status, body or "", dict(headers or [])

    def check_resource(self, request):
        """RFC 8707 §2: the resource asked for must be the one this server
        issues tokens for (the MCP spec has clients send it)."""
        _, url, _, body = request
        params = {**parse_qs(urlsplit(url).query), **parse_qs(body.decode())}
        asked = params.get("resource", [None])[0]
        if asked != self.resource:
            raise InvalidRequestError(f"resource {asked!r} is not {self.resource!r} (RFC 8707 invalid_target)")


def serve_as(port, resource, tenant):
    issuer = f"http://127.0.0.1:{port}/as"
    auth = AuthServer(issuer, resource, tenant)
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            pass

        def answer(self, status, body, headers):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            data = body.encode() if isinstance(body, str) else body
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def request_tuple(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            return (self.command, f"{issuer[: -len('/as')]}{self.path}", dict(self.headers), body)

        def json(self, doc):
            self.answer(200, json.dumps(doc), {"Content-Type": "application/json"})

        def do_GET(self):
            self.guarded(self.get)

        def do_POST(self):
            self.guarded(self.post)

        def guarded(self, handler):
            # A failure here is answered 500 with its traceback, so the
            # test shows it rather than a dropped connection.
            try:
                handler()
            except Exception:
                import traceback

                text = traceback.format_exc()
                print(text, file=sys.stderr, flush=True)
                self.answer(500, text, {"Content-Type": "text/plain"})

        def get(self):
            path = urlsplit(self.path).path
            seen.append(("GET", path))
            if path == "/.well-known/oauth-authorization-server/as":  # RFC 8414 §3.1
                return self.json(auth.metadata())
            if path == "/as/jwks":
                return self.json(KeySet([auth.key]).as_dict(private=False))
            if path == "/as/authorize":
                req = self.request_tuple()
                try:
                    auth.check_resource(req)
                    grant = auth.get_consent_grant(req, end_user=USER)
                except Exception as e:  # an OAuth2Error: say it to the test
                    return self.answer(400, f"authorize refused: {e!r}", {"Content-Type": "text/plain"})
                # Approved at once: the user is alice.
                return self.answer(*auth.create_authorization_response(req, grant_user=USER, grant=grant))
            self.answer(404, "not found", {"Content-Type": "text/plain"})

        def post(self):
            path = urlsplit(self.path).path
            seen.append(("POST", path))
            req = self.request_tuple()
            if path == "/as/register":
                return self.answer(*auth.create_endpoint_response("client_registration", req))
            if path == "/as/token":
                try:
                    auth.check_resource(req)
                except InvalidRequestError as e:
                    return self.answer(400, json.dumps({"error": "invalid_target", "error_description": e.description}), {"Content-Type": "application/json"})
                return self.answer(*auth.create_token_response(req))
            self.answer(404, "not found", {"Content-Type": "text/plain"})

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, auth, seen


# ------------------------------------------------------------ the client


class MemoryStorage:
    def __init__(self):
        self.tokens = None
        self.client_info = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client_info

    async def set_client_info(self, client_info):
        self.client_info = client_info


async def wait_for(url, timeout=60):
    base = url.rsplit("/", 1)[0]
    deadline = time.monotonic() + timeout
    async with httpx2.AsyncClient() as http:
        while True:
            try:
                if (await http.get(base + "/healthz")).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{base}/healthz did not answer within {timeout} s")
            await asyncio.sleep(0.05)


async def main(url, as_port, tenant):
    httpd, auth, seen = serve_as(as_port, url, tenant)
    print("AS READY", flush=True)
    await wait_for(url)
    redirect_uri = "http://127.0.0.1:1/callback"  # never reached: the handler reads the redirect
    got = {}

    async def redirect_handler(authorization_url):
        # What a browser would do, headless: the authorization server
        # approves at once and redirects to the client with the code.
        async with httpx2.AsyncClient() as http:
            r = await http.get(authorization_url, follow_redirects=False)
        check("the authorization endpoint redirects", r.status_code == 302, f"{r.status_code} {r.text}")
        location = r.headers["location"]
        check("to the registered redirect URI", location.startswith(redirect_uri), location)
        q = parse_qs(urlsplit(location).query)
        got["code"], got["state"] = q["code"][0], q.get("state", [None])[0]
        got["iss"] = q.get("iss", [None])[0]
        got["url"] = authorization_url

    async def callback_handler():
        return AuthorizationCodeResult(code=got["code"], state=got["state"], iss=got["iss"])

    storage = MemoryStorage()
    provider = OAuthClientProvider(
        server_url=url,
        client_metadata=OAuthClientMetadata(
            client_name="tine oauth test",
            redirect_uris=[redirect_uri],
            grant_types=["authorization_code"],
            response_types=["code"],
            token_endpoint_auth_method="none",
        ),
        storage=storage,
        redirect_handler=redirect_handler,
        callback_handler=callback_handler,
    )
    try:
        async with httpx2.AsyncClient(auth=provider, timeout=30) as http:
            async with streamable_http_client(url, http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    r = await session.call_tool("sandbox_list", {})
                    text = "".join(getattr(c, "text", "") for c in r.content)
                    check("sandbox_list answers", not r.is_error, text)
                    check("with the tenant's (empty) list", r.structured_content.get("sandboxes") == [], text)
    finally:
        httpd.shutdown()

    paths = [p for _, p in seen]
    check("the client read the AS metadata (RFC 8414)", "/.well-known/oauth-authorization-server/as" in paths, paths)
    check("registered itself (RFC 7591)", ("POST", "/as/register") in seen, seen)
    check("and exchanged a code for a token", ("POST", "/as/token") in seen, seen)
    q = parse_qs(urlsplit(got["url"]).query)
    check("PKCE S256 was used", q.get("code_challenge_method") == ["S256"], got["url"])
    check("the resource was asked for (RFC 8707)", q.get("resource") == [url], got["url"])
    check("one token was issued", auth.tokens_issued == 1, auth.tokens_issued)
    prm = provider.context.protected_resource_metadata
    check("the client read Tine's resource metadata (RFC 9728)", prm is not None and str(prm.resource) == url, prm)
    access = storage.tokens.access_token
    check("the access token is a JWT", access.count(".") == 2, access[:20])
    payload = access.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    check("for Tine (aud) and the tenant", (claims["aud"], claims["tenant"]) == (url, tenant), claims)
    print("ALL OK", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
