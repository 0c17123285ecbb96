"""Act: the co-restart plan and its guards, restarters, and the systemd D-Bus client."""
