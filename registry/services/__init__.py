"""What the Registry does, one service per act, over the backends it settled once."""
