"""Test support shared by tests/, e2e/ and bench/: free ports, Envoy command lines and
`--mode validate`, policy builders, process rigs, the proxy-wasm filter harness.

Never imported by meshfn itself (an import-linter contract says so).
"""
