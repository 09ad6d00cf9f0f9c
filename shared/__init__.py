"""The engine both the device and the coordinator use."""
