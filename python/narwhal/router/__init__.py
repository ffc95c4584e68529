"""The Narwhal router: intake -> admission -> placement -> relay."""
