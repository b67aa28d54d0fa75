"""What a configuration will cost before it runs: memory per rank and bytes per mesh axis."""
