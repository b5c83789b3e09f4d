"""The node agent: dials the control plane, reports the node, runs the shards it is given."""
