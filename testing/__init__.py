"""Test support shared by tests/, e2e/ and bench/ (bench scripts import it too: it is installed
with meshfn). Never imported by meshfn itself (tests/testing/test_testing_support.py checks).

ports      free loopback ports; `retry_on_port_clash` when one was taken before it was bound
envoy      the Envoy command line (meshfn's own, test defaults), `validate`, admin probes, start
processes  the process rig (`Processes`/`Proc`: by PID, logs, stop), `wait_for`, the meshfn CLI
policies   policy document builders and `Policies`, the small mesh most e2e tests run
ebpf       an accelerator attached for a test and checked to detach; a host without headers
filters    the built proxy-wasm filters and their native/static-Envoy harness
istio_cases the Istio golden cases: their paths, policies, renderings, and Istio's CRDs
onnx_models example ONNX models (skl2onnx exports, an MLP, a trained CNN, a decoder block) with
           held-out rows and tolerances, for the model compiler's tests and benchmarks
istio_cel  the CEL rules (x-kubernetes-validations) of Istio's CRDs, run on objects as a
           v1.25+ apiserver runs them (meshfn's v1.20 apiserver and jsonschema ignore them)
"""
