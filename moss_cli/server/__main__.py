from .main import server_command

server_command()
