"""ETC agent: elastic hybrid-parallel training with live device-to-device state migration."""

__version__ = "0.1.0"
