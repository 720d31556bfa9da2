"""Device layout: meshes, logical-axis sharding rules, and optimizer states in host memory."""
