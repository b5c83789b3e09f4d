# services.llmgw.server: the control plane and gateway, `llmgw server`.
#
# `settings` is llmgw's own server.yaml (docs/configuration.md), typed where the module
# reads a value itself and free-form elsewhere; the module adds only what it owns (the
# state directory, and the secret files as systemd credentials). The file is
# /etc/llmgw/server.yaml: `nixos-rebuild switch` reloads the server (SIGHUP) when only keys
# a reload applies changed, and restarts it otherwise. systemd holds the listening socket
# (llmgw-server.socket) and passes it to each server it starts, so a restart or an upgrade
# refuses no connection: the kernel queues them meanwhile.
#
# `monitoring` runs a Prometheus on the same machine that scrapes the server and, through
# the server's /api/metrics/targets, every node's node_exporter, with llmgw's alert rules
# (deploy/monitoring/llmgw-alerts.yml) and an Alertmanager on loopback.
#
# The flake passes its packages, so `package` defaults to its llmgw:
#   import ./nixos-modules/server.nix { packages = self.packages; }
{ packages }:
{ config, lib, pkgs, ... }:

let
  inherit (lib) mkIf mkOption mkEnableOption types optional optionals optionalString;
  shared = import ./lib.nix { inherit lib; };
  cfg = config.services.llmgw.server;
  yaml = pkgs.formats.yaml { };
  written = shared.withoutNulls cfg.settings;
  configFile = yaml.generate "llmgw-server.yaml" written;
  # The server reads server.yaml where a switch replaces it, as nginx's module does: the
  # unit itself then names no store path that changes with `settings`, and the triggers
  # below decide whether a switch reloads or restarts it.
  configPath = "/etc/llmgw/server.yaml";

  # What `systemctl reload` (SIGHUP) applies at once: llmgw/core/config_change.py's LIVE,
  # each a top-level key or a `section.key`. tests/nixos checks that they agree, key by key.
  liveKeys = [
    "models"
    "log_level"
    "gateway.first_byte_timeout_s"
    "gateway.idle_timeout_s"
    "gateway.queue_max"
    "gateway.queue_wait_s"
    "gateway.affinity"
    "gateway.affinity_epsilon"
    "auth.require_api_key"
    "auth.session_ttl_s"
  ];
  # server.yaml less one live key. A section left empty goes too: llmgw reads an absent
  # `gateway` or `auth` and an empty one alike.
  withoutKey = settings: key:
    let
      path = lib.splitString "." key;
      section = builtins.head path;
      rest = removeAttrs settings.${section} [ (lib.last path) ];
    in
    if builtins.length path == 1 then removeAttrs settings [ key ]
    else if !builtins.isAttrs (settings.${section} or null) then settings
    else if rest == { } then removeAttrs settings [ section ]
    else settings // { ${section} = rest; };
  # The settings only a restart applies: a switch that changes one of them restarts the
  # server, one that changes live keys alone reloads it.
  restartSettings = builtins.foldl' withoutKey written liveKeys;

  # Files the server reads reach it as systemd credentials: it runs as a dynamic user that
  # cannot read the operator's files, and they never enter the Nix store.
  credentialsDir = "/run/credentials/llmgw-server.service";
  tlsCredentials = {
    caFile = { key = "ca_file"; name = "tls-ca"; };
    caKeyFile = { key = "ca_key_file"; name = "tls-ca-key"; };
    certFile = { key = "cert_file"; name = "tls-cert"; };
    keyFile = { key = "key_file"; name = "tls-key"; };
  };
  credentials =
    optional (cfg.storePasswordFile != null) "store-password:${cfg.storePasswordFile}"
    ++ optional (cfg.adminTokenFile != null) "admin-token:${cfg.adminTokenFile}"
    ++ optional (cfg.metricsTokenFile != null) "metrics-token:${cfg.metricsTokenFile}"
    ++ optional (cfg.tracing.headersFile != null) "tracing-headers:${cfg.tracing.headersFile}"
    ++ optionals (cfg.tls != null) (lib.mapAttrsToList
      (option: c: "${c.name}:${toString cfg.tls.${option}}") tlsCredentials);

  # asyncpg reads PGPASSWORD when the URL has no password; exec keeps the pid systemd
  # named in LISTEN_PID.
  start = pkgs.writeShellScript "llmgw-server-start" ''
    ${optionalString (cfg.storePasswordFile != null) ''
      PGPASSWORD="$(< "$CREDENTIALS_DIRECTORY/store-password")"
      export PGPASSWORD
    ''}
    exec ${lib.getExe cfg.package} server --config ${configPath}
  '';

  listen = cfg.settings.listen;
  agentListen = if cfg.settings.tls == null then null else cfg.settings.tls.agent_listen;

  # Prometheus on this machine scrapes the server where it listens (a wildcard address
  # over loopback). The files it reads are its own systemd credentials, so they may stay
  # readable by root alone.
  monitoring = cfg.monitoring;
  scrapeAddress = shared.hostPort (shared.localHost listen.host) listen.port;
  scheme = if cfg.tls != null then "https" else "http";
  prometheusCredentials = "/run/credentials/prometheus.service";
  metricsSettings = cfg.settings.metrics or { };
  # llmgw lets a scrape in without a token only from loopback (metrics.allow_loopback).
  scrapedOverLoopback = shared.isLoopback (shared.localHost listen.host)
    && (metricsSettings.allow_loopback or true);
  serverTls = if cfg.tls == null then null else {
    ca_file = "${prometheusCredentials}/llmgw-ca";
    server_name = monitoring.tlsServerName;
  };
  serverJob = {
    job_name = "llmgw-server";
    inherit scheme;
    static_configs = [ { targets = [ scrapeAddress ]; } ];
    tls_config = serverTls;
    authorization = if cfg.metricsTokenFile == null then null else {
      type = "Bearer";
      credentials_file = "${prometheusCredentials}/llmgw-metrics-token";
    };
  };
  # NixOS's http_sd_configs take no `authorization`: the server answers them over loopback.
  nodesJob = {
    job_name = "llmgw-nodes";
    http_sd_configs = [ {
      url = "${scheme}://${scrapeAddress}/api/metrics/targets?port=${toString monitoring.nodeExporterPort}";
      tls_config = serverTls;
    } ];
  };
  prometheusFiles =
    optional (cfg.tls != null) "llmgw-ca:${toString cfg.tls.caFile}"
    ++ optional (cfg.metricsTokenFile != null) "llmgw-metrics-token:${cfg.metricsTokenFile}";
  alertmanager = monitoring.alertmanager;
in
{
  imports = shared.renamed "server" [
    { from = [ "listen" "host" ]; to = [ "settings" "listen" "host" ]; }
    { from = [ "listen" "port" ]; to = [ "settings" "listen" "port" ]; }
    { from = [ "allowPlainHttp" ]; to = [ "settings" "listen" "allow_plain_http" ]; }
    { from = [ "store" "url" ]; to = [ "settings" "store" "url" ]; }
    { from = [ "store" "passwordFile" ]; to = [ "storePasswordFile" ]; }
    { from = [ "models" ]; to = [ "settings" "models" ]; }
    { from = [ "engines" ]; to = [ "settings" "engines" ]; }
    { from = [ "engineMirror" ]; to = [ "settings" "engine_mirror" ]; }
    { from = [ "logLevel" ]; to = [ "settings" "log_level" ]; }
  ];

  options.services.llmgw.server = {
    enable = mkEnableOption "the llmgw server: control plane and OpenAI-compatible gateway";

    package = shared.packageOption packages pkgs;

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open `settings.listen.port` and, with `tls`, the agent stream's port in the firewall.";
    };

    storePasswordFile = shared.secretFile ''
      File holding the PostgreSQL password (the URL in `settings.store.url` has none), read
      at start as a systemd credential and given to asyncpg as PGPASSWORD.
    '';

    adminTokenFile = shared.secretFile ''
      File holding the admin token (server.yaml `auth.admin_token_file`), passed as a
      credential: every server of a cluster then takes the same token. null: the server
      makes one at first start in /var/lib/llmgw/secrets/admin-token.
    '';

    metricsTokenFile = shared.secretFile ''
      File holding the /metrics token (server.yaml `metrics.token_file`), passed as a credential.
    '';

    tls = mkOption {
      default = null;
      description = ''
        The cluster's CA and the server's certificate (server.yaml `tls`; `llmgw server init`
        writes the four files). Each is passed as a systemd credential, so it may be readable
        by root only. null: no TLS, no agent-stream mTLS listener.
      '';
      type = types.nullOr (types.submodule {
        options = {
          caFile = shared.publicFile "The cluster CA's certificate (`tls.ca_file`).";
          caKeyFile = shared.requiredSecretFile "The CA's private key, which signs node certificates (`tls.ca_key_file`).";
          certFile = shared.publicFile "The server's certificate (`tls.cert_file`).";
          keyFile = shared.requiredSecretFile "The server's private key (`tls.key_file`).";
        };
      });
    };

    tracing = shared.tracingOptions "llmgw-server";

    monitoring = {
      enable = mkEnableOption ''
        Prometheus on this machine, scraping this server's /metrics and every node's
        node_exporter (found through the server's /api/metrics/targets), with llmgw's alert
        rules and an Alertmanager on loopback'';

      scrapeInterval = mkOption {
        type = types.str;
        default = "15s";
        example = "30s";
        description = "How often Prometheus scrapes the server and the nodes, and evaluates the alert rules.";
      };

      nodeExporterPort = mkOption {
        type = types.nullOr types.port;
        default = 9100;
        description = ''
          The port of node_exporter on every node (services.llmgw.agent.monitoring.nodeExporter).
          null: scrape the server alone.
        '';
      };

      tlsServerName = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "cp1.example.org";
        description = ''
          With `tls`: the name Prometheus checks the server's certificate for, when the
          address it scrapes (the listen address, loopback for a wildcard one) is not one
          the certificate names. null: that address.
        '';
      };

      alertmanager = {
        enable = mkOption {
          type = types.bool;
          default = true;
          description = ''
            An Alertmanager on this machine, on 127.0.0.1 only and without clustering, that
            Prometheus sends the alerts to. Route them in
            services.prometheus.alertmanager.configuration; until then it holds them
            without notifying anyone.
          '';
        };
        port = mkOption {
          type = types.port;
          default = 9093;
          description = "Alertmanager's port on 127.0.0.1.";
        };
      };
    };

    settings = mkOption {
      default = { };
      example = lib.literalExpression ''
        {
          listen = { host = "10.0.0.1"; port = 8080; };
          store.url = "postgresql+asyncpg://llmgw@db.internal:5432/llmgw";
          models = [ { name = "sim-small"; profiles = [ { engine = "sim"; } ]; } ];
          gateway.queue_wait_s = 60;
        }
      '';
      description = ''
        server.yaml, with llmgw's keys as written there (docs/configuration.md). The keys below
        are typed; any other is written as given and checked by llmgw when the server starts.
        A null value is left out, so llmgw's default applies.
      '';
      type = types.submodule {
        freeformType = yaml.type;
        options = {
          listen = shared.listenOptions { host = "127.0.0.1"; port = 8080; } // {
            allow_plain_http = mkOption {
              type = types.bool;
              default = false;
              description = "Serve plain HTTP off loopback without `tls`: passwords and keys in the clear.";
            };
            server = mkOption {
              type = types.nullOr (types.enum [ "uvicorn" "granian" ]);
              default = null;
              example = "granian";
              description = "The HTTP server: uvicorn (null: llmgw's default; less CPU per request) or granian (docs/gateway.md, \"The HTTP server\").";
            };
          };
          state_dir = mkOption {
            type = types.str;
            default = "/var/lib/llmgw";
            readOnly = true;
            description = "The service's StateDirectory: the SQLite store, the admin token.";
          };
          store.url = mkOption {
            type = types.nullOr types.str;
            default = null;
            example = "postgresql+asyncpg://llmgw@db.internal:5432/llmgw";
            description = "SQLAlchemy URL of the store, without a password. null: SQLite in the state directory.";
          };
          tls = mkOption {
            default = null;
            description = "server.yaml `tls` beside the files (`services.llmgw.server.tls`), which the module writes.";
            type = types.nullOr (types.submodule {
              freeformType = yaml.type;
              options.agent_listen = shared.listenOptions { host = "0.0.0.0"; port = 8443; };
            });
          };
          log_level = mkOption {
            type = types.nullOr (types.enum [ "debug" "info" "warning" "error" ]);
            default = null;
            description = "How much the server logs. null: info.";
          };
          logging.access = mkOption {
            type = types.nullOr (types.enum [ "off" "json" ]);
            default = null;
            description = "`json`: one JSON line per /v1 request in the journal (never a prompt or an answer). null: off.";
          };
          models = mkOption {
            type = types.nullOr (types.listOf yaml.type);
            default = null;
            example = [ { name = "sim-small"; profiles = [ { engine = "sim"; } ]; } ];
            description = "The catalog, checked by llmgw when the server starts.";
          };
        };
      };
    };
  };

  config = mkIf cfg.enable {
    assertions = [
      {
        assertion = shared.isAddress listen.host;
        message = "services.llmgw.server.settings.listen.host = \"${listen.host}\": give an IP address or localhost; systemd's socket listens on it";
      }
      {
        assertion = cfg.tls != null || listen.allow_plain_http || shared.isLoopback listen.host;
        message = "services.llmgw.server.settings.listen.host = \"${listen.host}\" is not loopback and there is no `tls`: set services.llmgw.server.tls (the files `llmgw server init` writes), or settings.listen.allow_plain_http = true to serve passwords and keys in the clear";
      }
      {
        assertion = cfg.settings.tls == null || cfg.tls != null;
        message = "services.llmgw.server.settings.tls is set but services.llmgw.server.tls is not: give the four files there (`llmgw server init` writes them)";
      }
      {
        assertion = builtins.match "[^/]*://[^/@]*:[^/@]*@.*" (toString cfg.settings.store.url) == null;
        message = "services.llmgw.server.settings.store.url holds a password, which would be written into the world-readable Nix store: leave it out of the URL and give it in storePasswordFile";
      }
      {
        assertion = cfg.storePasswordFile == null
          || lib.hasPrefix "postgresql" (toString cfg.settings.store.url);
        message = "services.llmgw.server.storePasswordFile is for PostgreSQL: set settings.store.url to a postgresql+asyncpg:// URL, or drop the password file";
      }
    ] ++ optionals monitoring.enable [
      {
        assertion = metricsSettings.enabled or true;
        message = "services.llmgw.server.monitoring needs the server's /metrics: remove settings.metrics.enabled = false";
      }
      {
        assertion = scrapedOverLoopback || cfg.metricsTokenFile != null;
        message = "services.llmgw.server.monitoring: Prometheus scrapes the server at ${scrapeAddress}, which llmgw lets in without a token only over loopback (settings.metrics.allow_loopback): set services.llmgw.server.metricsTokenFile";
      }
      {
        assertion = monitoring.nodeExporterPort == null || scrapedOverLoopback;
        message = "services.llmgw.server.monitoring finds the nodes at ${scrapeAddress}/api/metrics/targets, which NixOS's Prometheus asks without a token, and llmgw answers that only over loopback: listen on a loopback or wildcard address (settings.listen.host = \"0.0.0.0\" or \"::\", the firewall as the fence) and keep settings.metrics.allow_loopback, or set monitoring.nodeExporterPort = null to scrape the server alone";
      }
    ] ++ shared.secretFileAssertions "services.llmgw.server" {
      inherit (cfg) storePasswordFile adminTokenFile metricsTokenFile;
    } ++ shared.secretFileAssertions "services.llmgw.server.tracing" {
      inherit (cfg.tracing) headersFile;
    } ++ optionals (cfg.tls != null) (shared.secretFileAssertions "services.llmgw.server.tls" {
      inherit (cfg.tls) caKeyFile keyFile;
    });

    services.llmgw.server.settings = {
      tls = mkIf (cfg.tls != null) (lib.mapAttrs' (option: c:
        lib.nameValuePair c.key "${credentialsDir}/${c.name}") tlsCredentials);
      auth = mkIf (cfg.adminTokenFile != null) { admin_token_file = "${credentialsDir}/admin-token"; };
      metrics = mkIf (cfg.metricsTokenFile != null) { token_file = "${credentialsDir}/metrics-token"; };
      tracing = shared.tracingSettings cfg.tracing
        (if cfg.tracing.headersFile == null then null else "${credentialsDir}/tracing-headers");
    };

    environment.systemPackages = [ cfg.package ];
    environment.etc.${lib.removePrefix "/etc/" configPath}.source = configFile;

    systemd.sockets.llmgw-server = {
      description = "llmgw server's listening socket";
      wantedBy = [ "sockets.target" ];
      listenStreams = [ (shared.hostPort listen.host listen.port) ];
      # One socket for every server process in turn (llmgw/server/listen.py takes it).
      # FreeBind: the address may come up after the socket does.
      socketConfig = { Accept = false; Backlog = 4096; FreeBind = true; };
    };

    systemd.services.llmgw-server = {
      description = "llmgw server: control plane and OpenAI-compatible gateway";
      wantedBy = [ "multi-user.target" ];
      requires = [ "llmgw-server.socket" ];
      # A local PostgreSQL: after its users and databases are set up (postgresql.target
      # on 25.11, the service itself before).
      after = [ "llmgw-server.socket" "network-online.target" ]
        ++ optionals config.services.postgresql.enable [ "postgresql.service" "postgresql.target" ];
      wants = [ "network-online.target" ];
      # nixos-rebuild switch restarts the server in one step instead of stopping it and
      # starting it later: the socket keeps queueing connections meanwhile.
      stopIfChanged = false;
      # A switch that changes only live keys reloads the server (switch-to-configuration
      # reloads a unit whose X-Reload-Triggers alone changed); any other change of
      # server.yaml changes X-Restart-Triggers too, and restarts it.
      reloadTriggers = [ configFile ];
      restartTriggers = [ (builtins.toJSON restartSettings) ];
      environment.PYTHONUNBUFFERED = "1";
      serviceConfig = {
        Type = "exec";
        ExecStart = start;
        # `systemctl reload llmgw-server`: /etc/llmgw/server.yaml read again
        # (docs/operations.md).
        ExecReload = "${pkgs.coreutils}/bin/kill -HUP $MAINPID";
        Restart = "on-failure";
        RestartSec = 2;
        DynamicUser = true;
        StateDirectory = "llmgw";
        StateDirectoryMode = "0700";
        LoadCredential = credentials;
        UMask = "0077";
        CapabilityBoundingSet = [ "" ];
        DevicePolicy = "closed";
        LockPersonality = true;
        # MemoryDenyWriteExecute stays off: cffi (argon2-cffi, cryptography) may need
        # writable and executable trampolines.
        NoNewPrivileges = true;
        PrivateDevices = true;
        PrivateTmp = true;
        PrivateUsers = true;
        ProcSubset = "pid";
        ProtectClock = true;
        ProtectControlGroups = true;
        ProtectHome = true;
        ProtectHostname = true;
        ProtectKernelLogs = true;
        ProtectKernelModules = true;
        ProtectKernelTunables = true;
        ProtectProc = "invisible";
        ProtectSystem = "strict";
        RemoveIPC = true;
        RestrictAddressFamilies = [ "AF_INET" "AF_INET6" "AF_UNIX" ];
        RestrictNamespaces = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        SystemCallArchitectures = "native";
        SystemCallFilter = [ "@system-service" "~@privileged" ];
        SystemCallErrorNumber = "EPERM";
      };
    };

    networking.firewall.allowedTCPPorts = mkIf cfg.openFirewall
      ([ listen.port ] ++ optional (cfg.tls != null)
        (if agentListen == null then 8443 else agentListen.port));

    services.prometheus = mkIf monitoring.enable {
      enable = true;
      # Its pages and API have no login.
      listenAddress = lib.mkDefault "127.0.0.1";
      globalConfig = {
        scrape_interval = monitoring.scrapeInterval;
        evaluation_interval = monitoring.scrapeInterval;
      };
      ruleFiles = [ ../deploy/monitoring/llmgw-alerts.yml ];
      scrapeConfigs = [ serverJob ] ++ optional (monitoring.nodeExporterPort != null) nodesJob;
      # promtool checks the file where the system is built, which has no /run/credentials.
      checkConfig = mkIf (prometheusFiles != [ ]) (lib.mkDefault "syntax-only");
      alertmanagers = mkIf alertmanager.enable [
        { static_configs = [ { targets = [ "127.0.0.1:${toString alertmanager.port}" ]; } ]; }
      ];
      alertmanager = mkIf alertmanager.enable {
        enable = true;
        listenAddress = "127.0.0.1";
        inherit (alertmanager) port;
        # A single Alertmanager: no gossip listener (0.0.0.0:9094 by default).
        extraFlags = [ "--cluster.listen-address=" ];
        configuration = lib.mkDefault {
          route.receiver = "nobody";
          receivers = [ { name = "nobody"; } ];
        };
      };
    };

    systemd.services.prometheus = mkIf (monitoring.enable && prometheusFiles != [ ]) {
      serviceConfig.LoadCredential = prometheusFiles;
    };
  };
}
