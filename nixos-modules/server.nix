# services.llmgw.server: the control plane and gateway, `llmgw server`.
#
# Thin: the options become llmgw's own server.yaml (lib.nix renderServer; every key is
# documented in docs/configuration.md) and one ExecStart. systemd holds the listening
# socket (llmgw-server.socket) and passes it to each server it starts, so a restart or an
# upgrade refuses no connection: the kernel queues them until the next server answers.
{ config, lib, pkgs, ... }:

let
  inherit (lib) mkIf mkOption mkEnableOption types optional optionals optionalString;
  cfg = config.services.llmgw.server;
  render = import ./lib.nix;
  yaml = pkgs.formats.yaml { };
  configFile = yaml.generate "llmgw-server.yaml" (render.renderServer cfg);
  # systemd needs an address: "localhost" listens on the IPv4 loopback.
  socketHost = if cfg.listen.host == "localhost" then "127.0.0.1" else cfg.listen.host;
  listenStream =
    if lib.hasInfix ":" socketHost then "[${socketHost}]:${toString cfg.listen.port}"
    else "${socketHost}:${toString cfg.listen.port}";
  credentials =
    optional (cfg.store.passwordFile != null) "store-password:${cfg.store.passwordFile}"
    ++ optional (cfg.metricsTokenFile != null) "metrics-token:${cfg.metricsTokenFile}"
    ++ optionals (cfg.tls != null) (map
      (option: "${render.serverTlsFiles.${option}.credential}:${cfg.tls.${option}}")
      (builtins.attrNames render.serverTlsFiles));
  # asyncpg reads PGPASSWORD when the URL has no password; exec keeps the pid systemd
  # named in LISTEN_PID.
  start = pkgs.writeShellScript "llmgw-server-start" ''
    ${optionalString (cfg.store.passwordFile != null) ''
      PGPASSWORD="$(< "$CREDENTIALS_DIRECTORY/store-password")"
      export PGPASSWORD
    ''}
    exec ${lib.getExe cfg.package} server --config ${configFile}
  '';
  listenOptions = defaults: {
    host = mkOption {
      type = types.str;
      default = defaults.host;
      example = "0.0.0.0";
      description = "Address to listen on (server.yaml `listen.host`): an IP address or localhost.";
    };
    port = mkOption {
      type = types.port;
      default = defaults.port;
      description = "TCP port (server.yaml `listen.port`).";
    };
  };
in
{
  options.services.llmgw.server = {
    enable = mkEnableOption "the llmgw server: control plane and OpenAI-compatible gateway";

    package = mkOption {
      type = types.package;
      defaultText = lib.literalExpression "llmgw.packages.\${system}.llmgw";
      description = "The llmgw package; the flake's nixosModules set it to its own.";
    };

    listen = listenOptions { inherit (render.defaults.server) host port; };

    allowPlainHttp = mkOption {
      type = types.nullOr types.bool;
      default = null;
      example = true;
      description = ''
        Serve plain HTTP on a non-loopback address without a `tls` block
        (server.yaml `listen.allow_plain_http`). null: llmgw's default, refused.
      '';
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the listen port (and tls.agentListen's) in the firewall.";
    };

    store = {
      url = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "postgresql+asyncpg://llmgw@db.internal:5432/llmgw";
        description = ''
          SQLAlchemy URL of the store (server.yaml `store.url`), without a password.
          null: SQLite in the state directory, /var/lib/llmgw/llmgw.db.
        '';
      };
      passwordFile = mkOption {
        type = types.nullOr types.path;
        default = null;
        example = "/run/secrets/llmgw-db-password";
        description = ''
          File holding the PostgreSQL password, read at start as a systemd credential and
          given to asyncpg as PGPASSWORD; it never enters the Nix store.
        '';
      };
    };

    tls = mkOption {
      default = null;
      description = ''
        The cluster's CA and the server's certificate (server.yaml `tls`; `llmgw server init`
        writes the four files). Each file is passed as a systemd credential, so it may be
        readable by root only. null: no TLS, no agent-stream mTLS listener.
      '';
      type = types.nullOr (types.submodule {
        options = {
          caFile = mkOption { type = types.path; description = "The cluster CA's certificate (`tls.ca_file`)."; };
          caKeyFile = mkOption { type = types.path; description = "The CA's private key, which signs node certificates (`tls.ca_key_file`)."; };
          certFile = mkOption { type = types.path; description = "The server's certificate (`tls.cert_file`)."; };
          keyFile = mkOption { type = types.path; description = "The server's private key (`tls.key_file`)."; };
          agentListen = mkOption {
            type = types.nullOr (types.submodule { options = listenOptions { host = "0.0.0.0"; port = 8443; }; });
            default = null;
            example = { host = "10.0.0.1"; port = 8443; };
            description = "Where agents' mTLS stream listens (`tls.agent_listen`). null: 0.0.0.0:8443.";
          };
          publicUrls = mkOption {
            type = types.nullOr (types.listOf types.str);
            default = null;
            example = [ "https://cp1.internal:8080" ];
            description = "The URLs nodes reach this cluster's API at (`tls.public_urls`).";
          };
          nodeCertDays = mkOption {
            type = types.nullOr types.number;
            default = null;
            description = "How long node certificates live (`tls.node_cert_days`). null: llmgw's default, 7.";
          };
        };
      });
    };

    metricsTokenFile = mkOption {
      type = types.nullOr types.path;
      default = null;
      description = "File holding the /metrics token (`metrics.token_file`), passed as a credential.";
    };

    models = mkOption {
      type = types.nullOr (types.listOf yaml.type);
      default = null;
      example = [ { name = "sim-small"; profiles = [ { engine = "sim"; } ]; } ];
      description = ''
        The catalog (server.yaml `models`), with llmgw's keys as written there
        (docs/configuration.md): checked by llmgw when the server starts.
      '';
    };

    engines = mkOption {
      type = types.nullOr (types.attrsOf yaml.type);
      default = null;
      example = { "llama.cpp" = { version = "b6981"; }; };
      description = ''
        Engine versions every node installs (server.yaml `engines`). `{ }` installs none:
        the right choice when nodes pin their engines from nixpkgs. null: llmgw's default.
      '';
    };

    engineMirror = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "https://mirror.internal/llmgw-engines";
      description = "An offline mirror of engine archives (server.yaml `engine_mirror`).";
    };

    logLevel = mkOption {
      type = types.nullOr (types.enum [ "debug" "info" "warning" "error" ]);
      default = null;
      description = "How much the server logs (`log_level`). null: info.";
    };

    settings = mkOption {
      type = yaml.type;
      default = { };
      example = { gateway.queue_wait_s = 60; auth.session_ttl_s = 3600; };
      description = ''
        Any other server.yaml key (gateway, auth, nodes, controller, metrics, engine
        overrides…), as written there; merged over what the options above render.
      '';
    };
  };

  config = mkIf cfg.enable {
    assertions = [
      {
        assertion = cfg.listen.host == "localhost" || builtins.match "[0-9a-fA-F.:]+" cfg.listen.host != null;
        message = "services.llmgw.server.listen.host must be an IP address or localhost: systemd's socket listens on it";
      }
    ];

    systemd.sockets.llmgw-server = {
      description = "llmgw server's listening socket";
      wantedBy = [ "sockets.target" ];
      listenStreams = [ listenStream ];
      # One socket for every server process in turn (llmgw/server/listen.py takes it).
      socketConfig = { Accept = false; Backlog = 4096; FreeBind = true; };
    };

    systemd.services.llmgw-server = {
      description = "llmgw server: control plane and OpenAI-compatible gateway";
      wantedBy = [ "multi-user.target" ];
      requires = [ "llmgw-server.socket" ];
      after = [ "llmgw-server.socket" "network-online.target" ]
        ++ optional config.services.postgresql.enable "postgresql.service";
      wants = [ "network-online.target" ];
      # On an upgrade, restart in one step: the socket queues connections meanwhile.
      stopIfChanged = false;
      restartTriggers = [ configFile ];
      environment.PYTHONUNBUFFERED = "1";
      serviceConfig = {
        ExecStart = start;
        Restart = "on-failure";
        RestartSec = 2;
        DynamicUser = true;
        StateDirectory = "llmgw";
        StateDirectoryMode = "0700";
        LoadCredential = credentials;
        UMask = "0077";
        NoNewPrivileges = true;
        PrivateTmp = true;
        PrivateDevices = true;
        ProtectSystem = "strict";
        ProtectHome = true;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        ProtectProc = "invisible";
        RestrictAddressFamilies = [ "AF_INET" "AF_INET6" "AF_UNIX" ];
        RestrictNamespaces = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        CapabilityBoundingSet = "";
        SystemCallArchitectures = "native";
        SystemCallFilter = [ "@system-service" "~@privileged" ];
        # MemoryDenyWriteExecute stays off: cffi (argon2, cryptography) may need
        # writable-executable trampolines.
      };
    };

    networking.firewall.allowedTCPPorts = mkIf cfg.openFirewall
      ([ cfg.listen.port ]
        ++ optional (cfg.tls != null)
          (if cfg.tls.agentListen == null then 8443 else cfg.tls.agentListen.port));
  };
}
