"""The profiler service: model registry, analytic and measured profiles in etcd, measured sweeps as jobs."""
