"""Node-side collectors: NVML, dcgm-exporter, InfiniBand sysfs; and the agent that runs them."""
