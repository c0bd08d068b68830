"""A JavaScript or TypeScript context's worker process: the Node.js program `workers.Worker`
runs with `node -e`."""

# A JavaScript context: Node.js, the cells run in one global scope (`vm.runInThisContext`, so a
# cell's value is its completion value); a promise value is awaited; `require` resolves from the
# context's cwd. Same pipes and messages as the Python worker. A TypeScript context is the same
# worker with each cell's types stripped first by esbuild (no type checking, as Node.js's own
# type stripping); a cell esbuild cannot parse is a SyntaxError.
JS_WORKER = r"""
'use strict';
const fs = require('fs');
const vm = require('vm');
const util = require('util');
const readline = require('readline');
const { createRequire } = require('module');
const [lang, reqFdArg, respFdArg] = process.argv.slice(-3);
const [reqFd, respFd] = [reqFdArg, respFdArg].map(Number);
const MARK = '\x1evmon-cell-end ';
const send = (m) => fs.writeSync(respFd, JSON.stringify(m) + '\n');
globalThis.require = createRequire(process.cwd() + '/');
process.on('SIGINT', () => {});
let count = 0;
function errorMsg(e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'message' in e)) {
    return { type: 'error', name: String(e.name || 'Error'), value: String(e.message),
             traceback: String(e.stack || e) };
  }
  return { type: 'error', name: 'Error', value: util.inspect(e), traceback: '' };
}
// Static ESM imports, which a script cannot hold, become `require`s (what Node.js's own
// ESM-to-CommonJS interop gives for built-ins and CommonJS packages); `var`, so a cell can run
// again.
function rewriteImports(code) {
  const q = `(['"][^'"\\n]+['"])`;
  return code
    .replace(new RegExp(`^([ \\t]*)import\\s+\\*\\s+as\\s+([\\w$]+)\\s+from\\s*${q}[ \\t]*;?`, 'gm'),
      '$1var $2 = require($3);')
    .replace(new RegExp(`^([ \\t]*)import\\s+\\{([^}]*)\\}\\s*from\\s*${q}[ \\t]*;?`, 'gm'),
      (m, ws, names, mod) => `${ws}var {${names.replace(/\s+as\s+/g, ': ')}} = require(${mod});`)
    .replace(new RegExp(`^([ \\t]*)import\\s+([\\w$]+)\\s*,\\s*\\{([^}]*)\\}\\s*from\\s*${q}[ \\t]*;?`, 'gm'),
      (m, ws, def, names, mod) =>
        `${ws}var ${def} = require(${mod}), {${names.replace(/\s+as\s+/g, ': ')}} = ${def};`)
    .replace(new RegExp(`^([ \\t]*)import\\s+([\\w$]+)\\s+from\\s*${q}[ \\t]*;?`, 'gm'),
      '$1var $2 = require($3);')
    .replace(new RegExp(`^([ \\t]*)import\\s*${q}[ \\t]*;?`, 'gm'), '$1require($2);');
}
// A cell with top-level `await` runs through Node.js's REPL evaluator (global scope, so its
// declarations outlive the cell; its value is its last expression's, awaited), as a notebook
// kernel's would.
// The REPL hands a cell's error to its domain, not to the eval's callback: a listener there
// ends the cell.
let replServer = null;
let replReject = null;
function replEval(code, filename) {
  if (!replServer) {
    const { PassThrough, Writable } = require('stream');
    replServer = require('repl').start({ input: new PassThrough(),
      output: new Writable({ write(c, e, cb) { cb(); } }),
      terminal: false, useGlobal: true, prompt: '' });
    replServer._domain.on('error', (e) => { if (replReject) replReject(e); });
  }
  return new Promise((resolve, reject) => {
    replReject = reject;
    replServer.eval(code, replServer.context, filename, (e, v) => (e ? reject(e) : resolve(v)));
  }).finally(() => { replReject = null; });
}
function stripTypes(code) {
  const r = require('child_process').spawnSync('esbuild', ['--loader=ts', '--log-level=error'],
    { input: code, encoding: 'utf8', maxBuffer: 1 << 28 });
  if (r.error) throw r.error;
  if (r.status !== 0) {
    const text = String(r.stderr || '').replace(/\x1b\[[0-9;]*m/g, '');
    const first = /\[ERROR\] (.*)/.exec(text);
    const e = new SyntaxError(first ? first[1] : text.trim());
    e.stack = text.trim();
    throw e;
  }
  return r.stdout;
}
async function run(req) {
  count += 1;
  const env = req.env_vars || {};
  const saved = {};
  for (const [k, v] of Object.entries(env)) {
    if (typeof v === 'string' && k && !k.includes('=') && !(k + v).includes('\0')) {
      saved[k] = process.env[k];
      process.env[k] = v;
    }
  }
  const filename = `<cell ${count}>`;
  let value, err = null;
  try {
    const code = rewriteImports(lang === 'ts' ? stripTypes(req.code || '') : (req.code || ''));
    try {
      value = vm.runInThisContext(code, { filename });
    } catch (e) {
      if (!(e instanceof SyntaxError) || !/await/.test(String(e.message))) throw e;
      value = await replEval(code, filename);
    }
    if (value && typeof value.then === 'function') value = await value;
  } catch (e) {
    err = errorMsg(e);
  }
  for (const [k, v] of Object.entries(saved)) {
    if (v === undefined) delete process.env[k]; else process.env[k] = v;
  }
  if (!err && value !== undefined) {
    globalThis._ = value;
    const text = typeof value === 'string' ? util.inspect(value) : util.inspect(value, { depth: 4 });
    send({ type: 'result', text, is_main_result: true });
  }
  if (err) send(err);
  send({ type: 'number_of_executions', execution_count: count });
  const marker = MARK + String(req.seq || 0) + '\n';
  for (const fd of [1, 2]) { try { fs.writeSync(fd, marker); } catch (e) {} }
  send({ type: 'done', seq: req.seq || 0 });
}
const lines = readline.createInterface({ input: fs.createReadStream(null, { fd: reqFd }) });
let chain = Promise.resolve();
lines.on('line', (line) => {
  let req;
  try { req = JSON.parse(line); } catch (e) { return; }
  chain = chain.then(() => run(req));
});
lines.on('close', () => chain.then(() => process.exit(0)));
send({ type: 'ready', pid: process.pid });
"""
