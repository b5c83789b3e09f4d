"""What only the node can know about itself."""
