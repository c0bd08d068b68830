"""The HTTP server: the API the `e2b-code-interpreter` SDK speaks.

`POST /execute` demands the sandbox's envd access token in `X-Access-Token`, which the official
SDK sends: the server asks envd (on this guest's loopback) whether the token is the current
one, so a token rotated at claim or resume is honoured at once. A request without it is
answered 401 and runs nothing. The context endpoints run no code and the SDK sends them no
token; a token they do carry must be the right one.

Endpoints: `GET /health`; `POST /execute` {code, context_id, language, env_vars} streaming
newline-delimited JSON (`stdout`, `stderr`, `result`, `error`, `number_of_executions`);
`POST /contexts` {language, cwd}; `GET /contexts`; `DELETE /contexts/{id}`;
`POST /contexts/{id}/restart`; `POST /contexts/{id}/interrupt`; `POST /warm` (token as for
`/execute`): runs an uncounted cell through the default Python kernel while nothing has run in
it yet, so the paths a first cell takes are translated before a sandbox is handed out (the
node's restore pool calls it; a cell after it sees the kernel as it was).
"""

import hmac
import json
import os
import pwd
import select
import shutil
import socket
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .common import BadRequest, default_cwd
from .contexts import CONTEXTS
from .workers import WorkerDied

MAX_BODY = 16 * 1024 * 1024
# How long the server waits for its default JavaScript context's Node.js to start.
JS_START_TIMEOUT = 300
LANGUAGES = {"python": "python", "python3": "python", "py": "python", "r": "r", "bash": "bash",
             "sh": "bash", "shell": "bash", "js": "js", "javascript": "js", "node": "js",
             "ts": "ts", "typescript": "ts"}
# Languages the SDK names that this guest has no kernel for: refused with the reason.
UNAVAILABLE = {
    "java": "Java contexts are not available: the guest image has no Java Jupyter kernel (Debian "
            "packages none, and the image is made from Debian's packages only); use python, r, ts, "
            "js or bash",
}
# What a TypeScript context needs besides Node.js: the cells' types are stripped with it.
ESBUILD = "esbuild"
NO_ESBUILD = ("TypeScript contexts are not available: no esbuild on this machine to strip the "
              "types (use language='js')")


def language_of(value):
    if value is None or value == "":
        return "python"
    name = value.strip().lower() if isinstance(value, str) else None
    if name in UNAVAILABLE:
        raise BadRequest(400, UNAVAILABLE[name])
    if name not in LANGUAGES:
        raise BadRequest(400, "unsupported language %r (this server runs python, r, js, ts and "
                         "bash)" % (value,))
    if LANGUAGES[name] == "ts" and shutil.which(ESBUILD) is None:
        raise BadRequest(400, NO_ESBUILD)
    return LANGUAGES[name]


ENVD_URL = os.environ.get("VMON_CI_ENVD", "http://127.0.0.1:49983")
MAX_TOKEN = 4096
# Never through a proxy the environment names: envd is on this machine.
_ENVD = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# envd rewrites this file after every `/init` (create, resume, a fork's child), where the token
# and the sandbox's environment variables are set.
ENVD_INIT_MARKER = os.environ.get("VMON_CI_ENVD_INIT_MARKER", "/run/vmon/envd-init")
# (marker text when asked, token, envs) of the last token envd accepted; replaced whole.
_accepted = None


def init_marker():
    try:
        with open(ENVD_INIT_MARKER, "rb") as f:
            return f.read(256) or None
    except OSError:
        return None


def sandbox_envs(token):
    """The sandbox's environment variables when envd accepts `token` as its access token
    (`GET /envs` answers 200; a sandbox created without a token answers 200 to anyone, as its
    envd does), else None. A token envd accepted is not asked about again until envd's init
    marker changes (no marker: always asked); a refused one is asked about every time."""
    if token is not None and len(token) > MAX_TOKEN:
        return None
    global _accepted
    marker = init_marker()
    hit = _accepted
    if marker is not None and hit is not None and hit[0] == marker and same_token(hit[1], token):
        return dict(hit[2])
    envs = ask_envd(token)
    if envs is not None and marker is not None:
        _accepted = (marker, token, dict(envs))
    return envs


def same_token(a, b):
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a.encode(), b.encode())


def ask_envd(token):
    headers = {} if token is None else {"X-Access-Token": token}
    req = urllib.request.Request(ENVD_URL + "/envs", headers=headers)
    try:
        with _ENVD.open(req, timeout=10) as r:
            body = r.read(1 << 20)
            if r.status != 200:
                return None
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        envs = json.loads(body or b"{}")
    except ValueError:
        envs = {}
    if not isinstance(envs, dict):
        return {}
    return {k: v for k, v in envs.items() if isinstance(k, str) and isinstance(v, str)}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vmon-code-interpreter/1"

    def setup(self):
        super().setup()
        # A cell's answer is several small writes (headers, then a chunk per message): without
        # this, Nagle holds each write after the first until the client's delayed ACK (~40 ms).
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def log_message(self, fmt, *args):
        if os.environ.get("VMON_CI_LOG"):
            sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    # -- helpers --

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_text(self, status, text):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_body(self):
        """Reads the whole body first, so an error answer leaves the connection usable."""
        self.body = b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise BadRequest(411, "a Content-Length is required")
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise BadRequest(400, "bad Content-Length")
        if n < 0 or n > MAX_BODY:
            self.close_connection = True
            raise BadRequest(413, "request body larger than %d bytes" % MAX_BODY)
        self.body = self.rfile.read(n) if n else b""
        if len(self.body) != n:
            self.close_connection = True
            raise BadRequest(400, "truncated body")

    def read_json(self):
        raw = self.body
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise BadRequest(400, "invalid JSON: %s" % e)
        if not isinstance(obj, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return obj

    def route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        try:
            if method == "GET" and parts == ["health"]:
                self.read_body()
                return self.send_json(200, {"status": "ok"})
            token = self.headers.get("X-Access-Token")
            needs_token = parts in (["execute"], ["warm"]) or token is not None
            self.envs = sandbox_envs(token) if needs_token else {}
            if self.envs is None:
                # The body is not read: the connection cannot be reused.
                self.close_connection = True
                return self.send_json(401, {"code": 401, "message": "invalid or missing access token"})
            self.read_body()
            if method == "POST" and parts == ["execute"]:
                return self.execute()
            if method == "POST" and parts == ["warm"]:
                self.read_json()
                ctx = CONTEXTS.existing_default("python")
                warmed = ctx is not None and ctx.warm()
                return self.send_json(200, {"warmed": warmed})
            if parts[:1] == ["contexts"]:
                if method == "GET" and len(parts) == 1:
                    self.read_json()
                    return self.send_json(200, CONTEXTS.list())
                if method == "POST" and len(parts) == 1:
                    return self.create_context()
                if method == "DELETE" and len(parts) == 2:
                    self.read_json()
                    if not CONTEXTS.remove(parts[1]):
                        raise BadRequest(404, "context %s not found" % parts[1])
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if method == "POST" and len(parts) == 3 and parts[2] == "restart":
                    self.read_json()
                    ctx = CONTEXTS.get(parts[1])
                    if ctx is None:
                        raise BadRequest(404, "context %s not found" % parts[1])
                    ctx.restart()
                    return self.send_json(200, ctx.info())
                if method == "POST" and len(parts) == 3 and parts[2] == "interrupt":
                    self.read_json()
                    ctx = CONTEXTS.get(parts[1])
                    if ctx is None:
                        raise BadRequest(404, "context %s not found" % parts[1])
                    ctx.interrupt()
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
            raise BadRequest(404, "no route %s %s" % (method, path))
        except BadRequest as e:
            return self.send_text(e.status, e.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # never let one request take the server down
            self.close_connection = True
            try:
                self.send_text(500, "internal error: %s: %s" % (type(e).__name__, e))
            except OSError:
                pass

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_DELETE(self):
        self.route("DELETE")

    def create_context(self):
        req = self.read_json()
        language = language_of(req.get("language"))
        cwd = req.get("cwd") or default_cwd()
        if not isinstance(cwd, str) or "\0" in cwd:
            raise BadRequest(400, "cwd must be a path")
        try:
            os.makedirs(cwd, exist_ok=True)
        except OSError as e:
            raise BadRequest(400, "cwd %s: %s" % (cwd, e.strerror))
        if not os.path.isdir(cwd):
            raise BadRequest(400, "cwd %s is not a directory" % cwd)
        if not os.access(cwd, os.X_OK):
            # Kernels run as the server's user (not root, as on E2B): say so instead of a
            # kernel that dies entering it.
            raise BadRequest(400, "cwd %s: permission denied (contexts run as %s)"
                             % (cwd, pwd.getpwuid(os.getuid()).pw_name))
        ctx = CONTEXTS.create(language, cwd)
        return self.send_json(200, ctx.info())

    def execute(self):
        req = self.read_json()
        code = req.get("code")
        if not isinstance(code, str):
            raise BadRequest(400, "code must be a string")
        env_vars = req.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
            raise BadRequest(400, "env_vars must map strings to strings")
        cid = req.get("context_id")
        if cid:
            if req.get("language"):
                raise BadRequest(400, "give context_id or language, not both")
            ctx = CONTEXTS.get(cid) if isinstance(cid, str) else None
            if ctx is None:
                raise BadRequest(404, "context %s not found" % (cid,))
        else:
            ctx = CONTEXTS.default_for(language_of(req.get("language")))

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.flush()
        alive = [True]

        def emit(msg):
            if not alive[0]:
                return False
            data = json.dumps(msg).encode() + b"\n"
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:
                alive[0] = False
            return alive[0]

        def disconnected():
            if not alive[0]:
                return True
            try:
                r, _, _ = select.select([self.connection], [], [], 0)
                if r and self.connection.recv(1, socket.MSG_PEEK) == b"":
                    alive[0] = False
            except OSError:
                alive[0] = False
            return not alive[0]

        try:
            ctx.execute(code, env_vars, emit, disconnected, self.envs)
        except WorkerDied as e:
            emit({"type": "error", "name": "ContextDied", "value": str(e), "traceback": ""})
        except Exception as e:  # the headers are out: report in the stream
            emit({"type": "error", "name": "InternalError",
                  "value": "%s: %s" % (type(e).__name__, e), "traceback": ""})
        if alive[0]:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True
        else:
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def main():
    import argparse

    p = argparse.ArgumentParser(description="vmon code-interpreter server")
    p.add_argument("--host", default=os.environ.get("VMON_CI_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(os.environ.get("VMON_CI_PORT", "49999")))
    args = p.parse_args()
    # A warm default kernel, so the first cell (and the template snapshot) has it ready.
    CONTEXTS.default_for("python", preload=True)
    # E2B's server also starts a default JavaScript context (listed by `list_code_contexts`).
    # The server answers only once Node.js has started: a template's snapshot is taken when it
    # answers, and a Node.js still starting in it (seconds of CPU under TCG) would finish its
    # start in every sandbox made from the snapshot, slowing their first seconds of cells.
    js = CONTEXTS.default_for("js")
    if not js.wait_ready(JS_START_TIMEOUT):
        sys.stderr.write("the default JavaScript context did not start in %d s\n" % JS_START_TIMEOUT)
    server = Server((args.host, args.port), Handler)
    sys.stderr.write("code interpreter listening on %s:%d\n" % (args.host, args.port))
    sys.stderr.flush()
    server.serve_forever()
