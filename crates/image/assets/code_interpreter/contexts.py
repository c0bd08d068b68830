"""The server's contexts: each made on request or as its language's default, by id."""

import threading
import uuid

from .common import default_cwd
from .kernels import KernelContext
from .workers import PipeContext


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = {}
        # A default context is made once even when its first cells come together; a kernel
        # start takes seconds, so it is not made under `lock`.
        self.making_default = threading.Lock()

    @staticmethod
    def _make(language, cwd, preload=False):
        cid = str(uuid.uuid4())
        if language in ("python", "r"):
            return KernelContext(cid, cwd, preload, language)
        return PipeContext(cid, language, cwd)

    def create(self, language, cwd):
        ctx = self._make(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language, preload=False):
        with self.making_default:
            with self.lock:
                cid = self.default.get(language)
                ctx = self.by_id.get(cid) if cid else None
            if ctx is not None:
                return ctx
            ctx = self._make(language, default_cwd(), preload)
            with self.lock:
                self.by_id[ctx.id] = ctx
                self.default[language] = ctx.id
            return ctx

    def existing_default(self, language):
        """The default context of `language` if it has been made (none is made here)."""
        with self.lock:
            cid = self.default.get(language)
            return self.by_id.get(cid) if cid else None

    def get(self, cid):
        with self.lock:
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
            for lang, d in list(self.default.items()):
                if d == cid:
                    del self.default[lang]
        if ctx is not None:
            ctx.close()
        return ctx is not None

    def list(self):
        with self.lock:
            return [c.info() for c in self.by_id.values()]


CONTEXTS = Contexts()
