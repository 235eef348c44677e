"""The job-owner CLI (``hetpilot submit|jobs|job|watch|budget|cancel|logs``) and the
``hetpilot nodes|drain|resume`` commands; channels to the daemon are
:mod:`hetpilot.channel`'s."""
