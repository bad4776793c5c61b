"""meshfn serverless inference backend: WASM model functions on wasmtime behind a KServe v2 API.

Modules: `engine` (wasmtime settings and the artifact key), `signing` (ed25519), `manifest` and
`build` (function sources -> .wasm), `registry` (publish, precompile, verify), `host` (instances),
`pool` (load, warm pool, scale to zero), `kserve` (request validation), `server` (HTTP), `config`
(function declarations), `cli` (`meshfn fn ...` and `python -m meshfn.inference serve`).
"""
