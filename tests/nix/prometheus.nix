# The options of NixOS's Prometheus modules that llmgw's modules set (monitoring), declared
# with the types NixOS 25.11 gives them: nixos/modules/services/monitoring/prometheus/
# default.nix (the server and its promTypes), alertmanager.nix, exporters.nix (node).
#
# Only the part llmgw reaches; each submodule keeps NixOS's own fields and no others, so a
# field NixOS's types lack (an `authorization` in http_sd_configs) fails here as it would
# there. Alertmanager's assertion is NixOS's too.
{ lib }:

{ config, ... }:

let
  inherit (lib) mkOption types;

  # nixos/modules/services/monitoring/prometheus/default.nix: mkOpt, mkDefOpt.
  mkOpt = type: description: mkOption { type = types.nullOr type; default = null; inherit description; };

  promTypes = {
    globalConfig = types.submodule {
      options = {
        scrape_interval = mkOpt types.str "How frequently to scrape targets by default.";
        scrape_timeout = mkOpt types.str "How long until a scrape request times out.";
        evaluation_interval = mkOpt types.str "How frequently to evaluate rules by default.";
        external_labels = mkOpt (types.attrsOf types.str) "Labels added when talking to external systems.";
        query_log_file = mkOpt types.str "Where to write the query log.";
      };
    };

    basic_auth = types.submodule {
      options = {
        username = mkOption { type = types.str; description = "HTTP username"; };
        password = mkOpt types.str "HTTP password";
        password_file = mkOpt types.str "HTTP password file";
      };
    };

    tls_config = types.submodule {
      options = {
        ca_file = mkOpt types.str "CA certificate to validate API server certificate with.";
        cert_file = mkOpt types.str "Certificate file for client cert authentication to the server.";
        key_file = mkOpt types.str "Key file for client cert authentication to the server.";
        server_name = mkOpt types.str "ServerName extension to indicate the name of the server.";
        insecure_skip_verify = mkOpt types.bool "Disable validation of the server certificate.";
      };
    };

    static_config = types.submodule {
      options = {
        targets = mkOption { type = types.listOf types.str; description = "The targets specified by the target group."; };
        labels = mkOption { type = types.attrsOf types.str; default = { }; description = "Labels assigned to all metrics scraped from the targets."; };
      };
    };

    http_sd_config = types.submodule {
      options = {
        url = mkOption { type = types.str; description = "URL from which the targets are fetched."; };
        refresh_interval = mkOpt types.str "Refresh interval to re-query the endpoint.";
        basic_auth = mkOpt promTypes.basic_auth "Authentication information used to authenticate to the API server.";
        proxy_url = mkOpt types.str "Optional proxy URL.";
        follow_redirects = mkOpt types.bool "Configure whether HTTP requests follow HTTP 3xx redirects.";
        tls_config = mkOpt promTypes.tls_config "Configures the scrape request's TLS settings.";
      };
    };

    scrape_config = types.submodule {
      options = {
        authorization = mkOption {
          type = types.nullOr types.attrs;
          default = null;
          description = "Sets the `Authorization` header on every scrape request with the configured credentials.";
        };
        job_name = mkOption { type = types.str; description = "The job name assigned to scraped metrics by default."; };
        scrape_interval = mkOpt types.str "How frequently to scrape targets from this job.";
        scrape_timeout = mkOpt types.str "Per-target timeout when scraping this job.";
        metrics_path = mkOpt types.str "The HTTP resource path on which to fetch metrics from targets.";
        honor_labels = mkOpt types.bool "Controls how Prometheus handles conflicts between labels.";
        scheme = mkOpt (types.enum [ "http" "https" ]) "The URL scheme with which to fetch metrics from targets.";
        params = mkOpt (types.attrsOf (types.listOf types.str)) "Optional HTTP URL parameters.";
        basic_auth = mkOpt promTypes.basic_auth "Basic authentication on every scrape request.";
        bearer_token = mkOpt types.str "A bearer token on every scrape request.";
        bearer_token_file = mkOpt types.str "A bearer token read from this file on every scrape request.";
        tls_config = mkOpt promTypes.tls_config "Configures the scrape request's TLS settings.";
        proxy_url = mkOpt types.str "Optional proxy URL.";
        http_sd_configs = mkOpt (types.listOf promTypes.http_sd_config) "List of HTTP service discovery configurations.";
        static_configs = mkOpt (types.listOf promTypes.static_config) "List of labeled target groups for this job.";
      };
    };
  };

  am = config.services.prometheus.alertmanager;
in
{
  options.services.prometheus = {
    enable = lib.mkEnableOption "Prometheus monitoring daemon";
    port = mkOption { type = types.port; default = 9090; description = "Port to listen on."; };
    listenAddress = mkOption { type = types.str; default = "0.0.0.0"; description = "Address to listen on."; };
    extraFlags = mkOption { type = types.listOf types.str; default = [ ]; description = "Extra commandline options."; };
    globalConfig = mkOption { type = promTypes.globalConfig; default = { }; description = "The global section."; };
    rules = mkOption { type = types.listOf types.str; default = [ ]; description = "Alerting and/or Recording rules."; };
    ruleFiles = mkOption { type = types.listOf types.path; default = [ ]; description = "Rules files."; };
    scrapeConfigs = mkOption { type = types.listOf promTypes.scrape_config; default = [ ]; description = "Scrape configurations."; };
    alertmanagers = mkOption { type = types.listOf types.attrs; default = [ ]; description = "Alertmanagers to send alerts to."; };
    webExternalUrl = mkOption { type = types.nullOr types.str; default = null; description = "The URL under which Prometheus is reachable."; };
    checkConfig = mkOption {
      type = types.either types.bool (types.enum [ "syntax-only" ]);
      default = true;
      description = "Check configuration with `promtool check`.";
    };
    retentionTime = mkOption { type = types.nullOr types.str; default = null; description = "How long to retain samples."; };

    alertmanager = {
      enable = lib.mkEnableOption "Prometheus Alertmanager";
      configuration = mkOption { type = types.nullOr types.attrs; default = null; description = "Alertmanager configuration."; };
      configText = mkOption { type = types.nullOr types.lines; default = null; description = "Alertmanager configuration as YAML text."; };
      checkConfig = mkOption { type = types.bool; default = true; description = "Check configuration with `amtool check-config`."; };
      logLevel = mkOption { type = types.enum [ "debug" "info" "warn" "error" "fatal" ]; default = "warn"; description = "Log level."; };
      webExternalUrl = mkOption { type = types.nullOr types.str; default = null; description = "The URL under which Alertmanager is reachable."; };
      listenAddress = mkOption { type = types.str; default = ""; description = "Address to listen on; empty: every interface."; };
      port = mkOption { type = types.port; default = 9093; description = "Port to listen on."; };
      openFirewall = mkOption { type = types.bool; default = false; description = "Open the port in the firewall."; };
      clusterPeers = mkOption { type = types.listOf types.str; default = [ ]; description = "Initial peers for HA cluster."; };
      extraFlags = mkOption { type = types.listOf types.str; default = [ ]; description = "Extra commandline options."; };
    };

    # nixos/modules/services/monitoring/prometheus/exporters.nix, for `node`.
    exporters.node = {
      enable = lib.mkEnableOption "the prometheus node exporter";
      port = mkOption { type = types.port; default = 9100; description = "Port to listen on."; };
      listenAddress = mkOption { type = types.str; default = "0.0.0.0"; description = "Address to listen on."; };
      openFirewall = mkOption { type = types.bool; default = false; description = "Open the port in the firewall."; };
      extraFlags = mkOption { type = types.listOf types.str; default = [ ]; description = "Extra commandline options."; };
      enabledCollectors = mkOption { type = types.listOf types.str; default = [ ]; description = "Collectors to enable."; };
      disabledCollectors = mkOption { type = types.listOf types.str; default = [ ]; description = "Collectors to disable."; };
    };
  };

  config.assertions = lib.optional am.enable {
    assertion = am.configuration != null || am.configText != null;
    message = "Can not enable alertmanager without a configuration. "
      + "Set either the `configuration` or `configText` attribute.";
  };
}
