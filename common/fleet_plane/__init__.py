"""The fleet's control plane over MQTT (proto/mqtt.md): topics, messages, and one connection kept up.

Edges (edge/fleet_agent.py) and cloud replicas (cloud/load_announcer.py) publish through it; the
operator's `sprinter fleet status | apply | push-verifier` read and write it. gRPC stays the data plane.
"""
