"""Rollouts: a controller in the feedback loop, like the drift breaker (meshfn.health).

It reads what the gateways measured of each version (Envoy's per-request access-log stream:
status and duration per version cluster) and what the inference backend compared on shadow
traffic, judges every step of a Function's Rollout on its SLOs, and moves the rollout: the next
step, promotion, rollback or a pause. Where a rollout is, is runtime state layered over the
policies (ir.Overlay.splits); the compositions re-render and push it (meshfn up) or apply it
(Kubernetes), exactly as every policy change. figures.py keeps the samples, checks.py judges
them, state.py is what survives a restart, controller.py decides.
"""
