"""The routing policy: workload classification and the learned route decision."""
