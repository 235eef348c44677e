"""Clients of the hetpilot.v1 contract: channel setup shared by the CLI and the
agents, and the job-owner CLI (``hetpilot submit|jobs|job|watch|budget|cancel``)."""
